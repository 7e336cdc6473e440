//! The data calls: read/write/send/recv and their vector, msg, `_chk` and mmsg variants,
//! sendfile and splice. A ring connection copies through its rings; a recorded TCP
//! connection goes to the kernel with byte counts; anything else straight to the kernel —
//! except a large `sendfile` when the user asked for the pipe service
//! (`MEMLOOP_PIPE_SENDFILE=1`, [`service_sendfile`]).

use super::datagram;
use super::{fail, hook, iovecs, iovecs_mut, slice, slice_mut, track};
use crate::conn::{Conn, SWITCHED};
use crate::dispatch::{self, Route};
use crate::plain::PlainTcp;
use crate::real;
use crate::table;
use libc::{c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;

/// A ring result as the C call's return value.
fn len(n: usize) -> ssize_t {
    n as ssize_t
}

/// A kernel receive on a recorded connection, counted (not for a peek).
fn received(p: &PlainTcp, r: ssize_t, flags: c_int) -> Result<ssize_t, c_int> {
    if flags & libc::MSG_PEEK == 0 {
        track("count", || p.count_received(r));
    }
    Ok(r)
}

fn sent(p: &PlainTcp, r: ssize_t) -> Result<ssize_t, c_int> {
    track("count", || p.count_sent(r));
    Ok(r)
}

/// A receive the kernel does (counted when the connection is recorded).
fn kernel_recv(
    p: Option<&PlainTcp>,
    flags: c_int,
    kernel: impl FnOnce() -> ssize_t,
) -> Result<ssize_t, c_int> {
    match p {
        Some(p) => received(p, kernel(), flags),
        None => Ok(kernel()),
    }
}

/// A send the kernel does: after the bytes a switch still re-sends, counted when recorded.
fn kernel_send(p: Option<&PlainTcp>, kernel: impl FnOnce() -> ssize_t) -> Result<ssize_t, c_int> {
    match p {
        Some(p) => {
            p.before_send();
            sent(p, kernel())
        }
        None => Ok(kernel()),
    }
}

/// What a ring closure returns when the call is the kernel's to make (an urgent-data
/// receive on a ring connection: the ring carries none).
const TO_KERNEL: c_int = 0x5357_4b4e;

/// A data call on `fd`: `ring` while the connection is ours to carry (on its ring, or on
/// TCP after a switch, which may bring it back), `plain` otherwise. A connection that changed
/// paths during the call with nothing moved ([`SWITCHED`]) is routed again, as often as it
/// changes: a kernel call on a connection of ours would take its doorbells for data.
fn data_call(
    fd: c_int,
    mut ring: impl FnMut(&Conn) -> Result<ssize_t, c_int>,
    plain: impl FnOnce(Option<&PlainTcp>) -> Result<ssize_t, c_int>,
) -> Result<ssize_t, c_int> {
    loop {
        let r = match dispatch::route(fd) {
            Route::Ring(c) | Route::Switched(c) => ring(&c),
            Route::Counted(p) => match crate::late::enter(fd, &p) {
                crate::late::Enter::Go(_in_flight) => return plain(Some(&p)),
                crate::late::Enter::Reroute => continue,
            },
            Route::Real => return plain(None),
            Route::Busy => return Err(libc::EAGAIN),
        };
        match r {
            Err(SWITCHED) => continue,
            Err(TO_KERNEL) => return plain(None),
            r => return r,
        }
    }
}

/// A single-buffer receive (`read`, `recv`, `recvfrom`): from the ring (after `on_ring`), or
/// the kernel's, counted for a recorded TCP connection. The ring carries no urgent data: a
/// `MSG_OOB` receive is the kernel's (after a switch the peer's urgent byte is there).
///
/// # Safety
/// `buf` must be writable for `n` bytes (or `n == 0`).
unsafe fn recv_one(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    kernel: impl FnOnce() -> ssize_t,
    mut on_ring: impl FnMut(),
) -> Result<ssize_t, c_int> {
    if flags & libc::MSG_OOB != 0 {
        crate::late::taint(fd, "urgent data");
    }
    let ring = |c: &Conn| {
        if flags & libc::MSG_OOB != 0 && c.path() == crate::conn::Path::Ring {
            return Err(TO_KERNEL);
        }
        on_ring();
        // SAFETY: the caller's contract.
        let buf = unsafe { slice_mut(buf, n) };
        c.recv(&mut [IoSliceMut::new(buf)], flags).map(len)
    };
    data_call(fd, ring, |p| kernel_recv(p, flags, kernel))
}

/// A single-buffer send (`write`, `send`, `sendto`): into the ring, or the kernel's, counted
/// for a recorded TCP connection. `MSG_OOB` moves the connection to TCP first.
///
/// # Safety
/// `buf` must be readable for `n` bytes (or `n == 0`).
unsafe fn send_one(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    kernel: impl FnOnce() -> ssize_t,
) -> Result<ssize_t, c_int> {
    if flags & libc::MSG_OOB != 0 {
        dispatch::before_urgent(fd);
    }
    let ring = |c: &Conn| {
        // SAFETY: the caller's contract.
        let buf = unsafe { slice(buf, n) };
        c.send(&[IoSlice::new(buf)], flags).map(len)
    };
    data_call(fd, ring, |p| kernel_send(p, kernel))
}

// ---- receive ----------------------------------------------------------------------------------

hook! {
    fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t;
    real kernel = real::read, pass if table::kind(fd) != table::K_OBJ =>
        // SAFETY: the hook's own buffer, as its contract gives it.
        unsafe { datagram::without_stale_wakes(fd, buf, count, 0, kernel) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: read's contract: `buf` is writable for `count` bytes.
        if let Some(r) = unsafe { datagram::recv_one(fd, buf, count, 0, (std::ptr::null_mut(), std::ptr::null_mut())) } {
            return r;
        }
        // SAFETY: as above.
        unsafe { recv_one(fd, buf, count, 0, kernel, || {}) }
    }
}

hook! {
    fn __read_chk(fd: c_int, buf: *mut c_void, count: size_t, _buflen: size_t) -> ssize_t;
    on_panic fail(libc::EIO);
    {
        // SAFETY: read's contract, which the caller of the checked variant also keeps.
        Ok(unsafe { read(fd, buf, count) })
    }
}

hook! {
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    real kernel = real::recv, pass if table::kind(fd) != table::K_OBJ =>
        // SAFETY: the hook's own buffer, as its contract gives it.
        unsafe { datagram::without_stale_wakes(fd, buf, n, flags, kernel) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: recv's contract: `buf` is writable for `n` bytes.
        if let Some(r) = unsafe { datagram::recv_one(fd, buf, n, flags, (std::ptr::null_mut(), std::ptr::null_mut())) } {
            return r;
        }
        // SAFETY: as above.
        unsafe { recv_one(fd, buf, n, flags, kernel, || {}) }
    }
}

hook! {
    fn __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, _buflen: size_t, flags: c_int)
        -> ssize_t;
    on_panic fail(libc::EIO);
    {
        // SAFETY: recv's contract, which the caller of the checked variant also keeps.
        Ok(unsafe { recv(fd, buf, n, flags) })
    }
}

hook! {
    fn recvfrom(
        fd: c_int,
        buf: *mut c_void,
        n: size_t,
        flags: c_int,
        addr: *mut sockaddr,
        alen: *mut socklen_t,
    ) -> ssize_t;
    real kernel = real::recvfrom, pass if table::kind(fd) != table::K_OBJ =>
        // SAFETY: the hook's own buffer, as its contract gives it.
        unsafe { datagram::without_stale_wakes(fd, buf, n, flags, kernel) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: recvfrom's contract: `buf` writable for `n` bytes, `addr`/`alen` valid.
        if let Some(r) = unsafe { datagram::recv_one(fd, buf, n, flags, (addr, alen)) } {
            return r;
        }
        let no_source = || {
            // SAFETY: recvfrom's contract: `alen` is null or a writable socklen_t.
            if let Some(alen) = unsafe { alen.as_mut() } {
                *alen = 0; // as TCP: no source address for a connected stream
            }
        };
        // SAFETY: recvfrom's contract: `buf` is writable for `n` bytes.
        unsafe { recv_one(fd, buf, n, flags, kernel, no_source) }
    }
}

hook! {
    fn __recvfrom_chk(
        fd: c_int,
        buf: *mut c_void,
        n: size_t,
        _buflen: size_t,
        flags: c_int,
        addr: *mut sockaddr,
        alen: *mut socklen_t,
    ) -> ssize_t;
    on_panic fail(libc::EIO);
    {
        // SAFETY: recvfrom's contract, which the caller of the checked variant also keeps.
        Ok(unsafe { recvfrom(fd, buf, n, flags, addr, alen) })
    }
}

hook! {
    fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t;
    real kernel = real::readv, pass if table::kind(fd) != table::K_OBJ;
    on_panic fail(libc::EIO);
    {
        // SAFETY: readv's contract: `iov` holds `n` iovecs of writable buffers.
        if let Some(r) = unsafe { datagram::readv(fd, iov, n) } {
            return Ok(r);
        }
        data_call(
            fd,
            // SAFETY: readv's contract: `iov` holds `n` iovecs of writable buffers.
            |c| c.recv(&mut unsafe { iovecs_mut(iov, n) }, 0).map(len),
            |p| kernel_recv(p, 0, kernel),
        )
    }
}

hook! {
    fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t;
    real kernel = real::recvmsg,
        // SAFETY: recvmsg's contract: `msg` is null or a readable msghdr.
        pass if table::kind(fd) != table::K_OBJ && !unsafe { has_control(msg) } =>
        // SAFETY: as above.
        unsafe { datagram::msg_without_stale_wakes(fd, msg, flags, kernel) };
    on_panic fail(libc::EIO);
    {
        if table::kind(fd) != table::K_OBJ {
            // Another kind of socket, with room for control data: fds may come in.
            let r = kernel();
            if r >= 0 {
                // SAFETY: the kernel filled `msg`'s control buffer within its length.
                let fds = unsafe { passed_fds(msg) };
                if !fds.is_empty() {
                    crate::conn::adopt_received(&fds);
                }
            }
            return Ok(r);
        }
        // SAFETY: recvmsg's contract: `msg` is null or a valid msghdr.
        if let Some(r) = unsafe { datagram::recvmsg(fd, msg, flags) } {
            return r;
        }
        let ring = |c: &Conn| {
            if flags & libc::MSG_OOB != 0 && c.path() == crate::conn::Path::Ring {
                return Err(TO_KERNEL); // no urgent data on a ring: the kernel answers
            }
            // SAFETY: recvmsg's contract: `msg` is null or a readable, writable msghdr.
            let m = unsafe { msg.as_mut() }.ok_or(libc::EFAULT)?;
            let (namelen, controllen) = (m.msg_namelen, m.msg_controllen);
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: recvmsg's contract: `msg_iov` holds `msg_iovlen` writable iovecs.
            let mut bufs = unsafe { iovecs_mut(m.msg_iov, m.msg_iovlen as c_int) };
            let r = c.recv(&mut bufs, flags).map(len);
            if r == Err(SWITCHED) {
                // The kernel gets the header as the program gave it.
                (m.msg_namelen, m.msg_controllen) = (namelen, controllen);
            }
            r
        };
        data_call(fd, ring, |p| kernel_recv(p, flags, kernel))
    }
}

hook! {
    fn recvmmsg(
        fd: c_int,
        msgs: *mut libc::mmsghdr,
        n: libc::c_uint,
        flags: c_int,
        timeout: *mut libc::timespec,
    ) -> c_int;
    real kernel = real::recvmmsg,
        // SAFETY: recvmmsg's contract: `msgs` holds `n` readable mmsghdrs.
        pass if table::kind(fd) != table::K_OBJ && !unsafe { any_control(msgs, n) };
    on_panic fail(libc::EIO);
    {
        if table::kind(fd) != table::K_OBJ {
            // Another kind of socket, with room for control data: fds may come in.
            let r = kernel();
            // SAFETY: the kernel filled the first `r` headers' control buffers.
            let fds = unsafe { passed_fds_mmsg(msgs, r.max(0) as libc::c_uint) };
            if !fds.is_empty() {
                crate::conn::adopt_received(&fds);
            }
            return Ok(r);
        }
        let udp = datagram::udp(fd).is_some();
        if !udp && !matches!(dispatch::route(fd), Route::Ring(_) | Route::Switched(_)) {
            return Ok(kernel());
        }
        let mut done = 0;
        let mut f = flags & !libc::MSG_WAITFORONE;
        for i in 0..n as usize {
            // SAFETY: recvmmsg's contract: `msgs` holds `n` writable mmsghdrs.
            let m = unsafe { &mut *msgs.add(i) };
            // SAFETY: each header is a valid msghdr, as recvmsg needs.
            let r = unsafe { recvmsg(fd, &mut m.msg_hdr, f) };
            if r <= 0 {
                return Ok(if done > 0 {
                    done
                } else if r == 0 {
                    0
                } else {
                    -1 // errno as recvmsg set it
                });
            }
            m.msg_len = r as libc::c_uint;
            done += 1;
            if flags & libc::MSG_WAITFORONE != 0 {
                f |= libc::MSG_DONTWAIT;
            }
        }
        Ok(done)
    }
}

// ---- send -------------------------------------------------------------------------------------

hook! {
    fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t;
    real kernel = real::write, pass if !ours_to_send(fd);
    on_panic fail(libc::EIO);
    {
        // SAFETY: write's contract: `buf` is readable for `count` bytes.
        if let Some(r) = datagram::send(fd, &[unsafe { slice(buf, count) }], 0, None) {
            return Ok(r);
        }
        // SAFETY: as above.
        unsafe { send_one(fd, buf, count, 0, kernel) }
    }
}

hook! {
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    real kernel = real::send, pass if !ours_to_send(fd);
    on_panic fail(libc::EIO);
    {
        // SAFETY: send's contract: `buf` is readable for `n` bytes.
        if let Some(r) = datagram::send(fd, &[unsafe { slice(buf, n) }], flags, None) {
            return Ok(r);
        }
        // SAFETY: as above.
        unsafe { send_one(fd, buf, n, flags, kernel) }
    }
}

hook! {
    fn sendto(
        fd: c_int,
        buf: *const c_void,
        n: size_t,
        flags: c_int,
        addr: *const sockaddr,
        alen: socklen_t,
    ) -> ssize_t;
    real kernel = real::sendto, pass if !ours_to_send(fd);
    on_panic fail(libc::EIO);
    {
        // SAFETY: sendto's contract: `addr` readable for `alen` bytes (or null).
        let dst = unsafe { real::decode_sockaddr(addr, alen) };
        // SAFETY: sendto's contract: `buf` is readable for `n` bytes.
        if let Some(r) = datagram::send(fd, &[unsafe { slice(buf, n) }], flags, dst) {
            return Ok(r);
        }
        // SAFETY: as above.
        unsafe { send_one(fd, buf, n, flags, kernel) }
    }
}

hook! {
    fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t;
    real kernel = real::writev, pass if !ours_to_send(fd);
    on_panic fail(libc::EIO);
    {
        if datagram::may_send(fd) {
            // SAFETY: writev's contract: `iov` holds `n` iovecs of readable buffers.
            let bufs = unsafe { iovecs(iov, n) };
            let parts: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
            if let Some(r) = datagram::send(fd, &parts, 0, None) {
                return Ok(r);
            }
        }
        data_call(
            fd,
            // SAFETY: writev's contract: `iov` holds `n` iovecs of readable buffers.
            |c| c.send(&unsafe { iovecs(iov, n) }, 0).map(len),
            |p| kernel_send(p, kernel),
        )
    }
}

hook! {
    fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t;
    real kernel = real::sendmsg,
        // SAFETY: sendmsg's contract: `msg` is null or a readable msghdr.
        pass if !ours_to_send(fd) && !unsafe { has_control(msg) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: sendmsg's contract: `msg` is null or a readable msghdr with valid control.
        if let Some(r) = unsafe { send_datagram_msg(fd, msg, flags) } {
            return Ok(r);
        }
        // SAFETY: sendmsg's contract: `msg` is null or a readable msghdr with valid control.
        let passed = unsafe { passed_fds(msg) };
        if !passed.is_empty() {
            dispatch::before_passing(&passed)?; // EBUSY: it must not go (nothing sent)
        }
        if flags & libc::MSG_OOB != 0 {
            dispatch::before_urgent(fd);
        }
        let ring = |c: &Conn| {
            // SAFETY: sendmsg's contract: `msg` is null or a readable msghdr.
            let m = unsafe { msg.as_ref() }.ok_or(libc::EFAULT)?;
            // SAFETY: sendmsg's contract: `msg_iov` holds `msg_iovlen` readable iovecs.
            let bufs = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) };
            c.send(&bufs, flags).map(len)
        };
        data_call(fd, ring, |p| kernel_send(p, kernel))
    }
}

hook! {
    fn sendmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int;
    real kernel = real::sendmmsg,
        // SAFETY: sendmmsg's contract: `msgs` holds `n` readable mmsghdrs.
        pass if !ours_to_send(fd) && !unsafe { any_control(msgs, n) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: sendmmsg's contract: `msgs` holds `n` readable mmsghdrs with valid control.
        let passed = unsafe { passed_fds_mmsg(msgs, n) };
        if !passed.is_empty() {
            dispatch::before_passing(&passed)?; // EBUSY: it must not go (nothing sent)
        }
        let udp = table::kind(fd) == table::K_UDP || datagram::udp(fd).is_some();
        if !udp && table::kind(fd) != table::K_OBJ {
            return Ok(kernel());
        }
        if !udp && !matches!(dispatch::route(fd), Route::Ring(_) | Route::Switched(_)) {
            return Ok(kernel());
        }
        let mut done = 0;
        for i in 0..n as usize {
            // SAFETY: sendmmsg's contract: `msgs` holds `n` writable mmsghdrs.
            let m = unsafe { &mut *msgs.add(i) };
            // SAFETY: each header is a valid msghdr, as sendmsg needs.
            let r = unsafe { sendmsg(fd, &m.msg_hdr, flags) };
            if r < 0 {
                return Ok(if done > 0 { done } else { -1 }); // errno as sendmsg set it
            }
            m.msg_len = r as libc::c_uint;
            done += 1;
        }
        Ok(done)
    }
}

/// sendfile onto a ring: read the file at an explicit offset and send; the file position (or
/// `*offset`) advances by what was actually sent.
///
/// # Safety
/// `offset` must be null or point to a readable, writable `off64_t`.
unsafe fn ring_sendfile(
    c: &Conn,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> Result<ssize_t, c_int> {
    // SAFETY: null or a valid off64_t, by the contract.
    let given = unsafe { offset.as_mut() };
    let mut pos = match &given {
        Some(o) => **o,
        // SAFETY: lseek64 takes no pointers.
        None => unsafe { libc::lseek64(in_fd, 0, libc::SEEK_CUR) },
    };
    if pos < 0 {
        return Err(real::errno());
    }
    let mut buf = vec![0u8; count.min(256 * 1024)];
    let mut total = 0usize;
    let mut result = Ok(());
    while total < count {
        let want = (count - total).min(buf.len());
        // SAFETY: `buf` is writable for `want` <= its length bytes.
        let n = unsafe { libc::pread64(in_fd, buf.as_mut_ptr().cast(), want, pos) };
        if n <= 0 {
            if n < 0 && total == 0 {
                result = Err(real::errno());
            }
            break;
        }
        match c.send(&[IoSlice::new(&buf[..n as usize])], 0) {
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
    match given {
        Some(o) => *o = pos,
        None => {
            // SAFETY: lseek64 takes no pointers.
            if unsafe { libc::lseek64(in_fd, pos, libc::SEEK_SET) } < 0 {
                tracing::debug!(
                    in_fd,
                    errno = real::errno(),
                    "sendfile: file position not set"
                );
            }
        }
    }
    result.map(|()| len(total))
}

/// The largest count one `sendfile` moves (the kernel's `MAX_RW_COUNT`).
const MAX_RW_COUNT: size_t = 0x7fff_f000;

/// `sendfile` on a kernel descriptor moved by the pipe service (`MEMLOOP_PIPE_SENDFILE=1`,
/// `count` ≥ `MEMLOOP_PIPE_SENDFILE_MIN`; see `crate::pipe`), else by `kernel`. Only a regular
/// file source: the service reads it at the offset given, or at the file's position, which is
/// read here and set to where the transfer ended, as the kernel does (it reads the position,
/// moves, and writes it back). A non-blocking sink that is full now gets the kernel's answer
/// (`EAGAIN`) at once.
///
/// # Safety
/// `offset` must be null or point to a readable, writable `off64_t`.
unsafe fn service_sendfile(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
    kernel: impl FnOnce() -> ssize_t,
) -> ssize_t {
    if !crate::pipe::sendfile_wanted(count)
        || real::fstat_mode(in_fd).map_or(true, |m| m & libc::S_IFMT != libc::S_IFREG)
        || real::fd_flags(out_fd) < 0
    {
        return kernel();
    }
    let count = count.min(MAX_RW_COUNT);
    // SAFETY: null or a valid off64_t, by the contract.
    let given = unsafe { offset.as_mut() };
    let start = match &given {
        Some(o) => **o,
        // SAFETY: lseek64 takes no pointers.
        None => unsafe { libc::lseek64(in_fd, 0, libc::SEEK_CUR) },
    };
    if start < 0 {
        return kernel(); // (a bad offset: the kernel's EINVAL)
    }
    let nonblock = real::status_flags(out_fd) & libc::O_NONBLOCK != 0;
    if nonblock
        && real::wait_fd(out_fd, libc::POLLOUT, Some(std::time::Duration::ZERO))
            .map_or(true, |ev| ev & libc::POLLOUT == 0)
    {
        return kernel();
    }
    // SAFETY: both are open descriptors of this process (`fstat` and `F_GETFD` succeeded just
    // now), borrowed for this call only, during which sendfile's contract keeps them open;
    // the borrows are only handed to system calls (one closed meanwhile fails with EBADF).
    let (out, inp) = unsafe {
        (
            BorrowedFd::borrow_raw(out_fd),
            BorrowedFd::borrow_raw(in_fd),
        )
    };
    match crate::pipe::sendfile(out, inp, start as u64, count as u64, nonblock) {
        crate::pipe::Sent::Moved(n) => {
            let end = start + n as i64;
            match given {
                Some(o) => *o = end,
                None => {
                    // SAFETY: lseek64 takes no pointers.
                    if unsafe { libc::lseek64(in_fd, end, libc::SEEK_SET) } < 0 {
                        tracing::debug!(in_fd, errno = real::errno(), "sendfile: position not set");
                    }
                }
            }
            n as ssize_t
        }
        crate::pipe::Sent::Failed(e) => {
            real::set_errno(e);
            -1
        }
        crate::pipe::Sent::Kernel => kernel(),
    }
}

hook! {
    fn sendfile(out_fd: c_int, in_fd: c_int, offset: *mut libc::off_t, count: size_t)
        -> ssize_t;
    real kernel = real::sendfile,
        pass if table::kind(out_fd) != table::K_OBJ && !crate::pipe::sendfile_wanted(count);
    on_panic fail(libc::EIO);
    {
        data_call(
            out_fd,
            // SAFETY: sendfile's contract: `offset` is null or a valid off_t (= off64_t here).
            |c| unsafe { ring_sendfile(c, in_fd, offset.cast(), count) },
            // SAFETY: as above.
            |p| kernel_send(p, || unsafe {
                service_sendfile(out_fd, in_fd, offset.cast(), count, kernel)
            }),
        )
    }
}

hook! {
    fn sendfile64(out_fd: c_int, in_fd: c_int, offset: *mut libc::off64_t, count: size_t)
        -> ssize_t;
    real kernel = real::sendfile64,
        pass if table::kind(out_fd) != table::K_OBJ && !crate::pipe::sendfile_wanted(count);
    on_panic fail(libc::EIO);
    {
        data_call(
            out_fd,
            // SAFETY: sendfile64's contract: `offset` is null or a valid off64_t.
            |c| unsafe { ring_sendfile(c, in_fd, offset, count) },
            // SAFETY: as above.
            |p| kernel_send(p, || unsafe {
                service_sendfile(out_fd, in_fd, offset, count, kernel)
            }),
        )
    }
}

/// splice from a pipe or file into a ring: never more than the ring has room for, so no byte
/// is taken that cannot be delivered.
///
/// # Safety
/// `off_in` must be null or point to a readable, writable `loff_t`.
unsafe fn splice_into_ring(
    c: &Conn,
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    len: size_t,
    nonblock: bool,
) -> Result<usize, c_int> {
    let room = c.wait_room(len.min(1 << 20), nonblock)?;
    let mut buf = vec![0u8; room];
    // SAFETY: null or a valid loff_t, by the contract.
    let n = match unsafe { off_in.as_mut() } {
        // SAFETY: `buf` is writable for `room` bytes.
        None => unsafe { real::read()(fd_in, buf.as_mut_ptr().cast(), room) },
        Some(off) => {
            // SAFETY: as above.
            let n = unsafe { libc::pread64(fd_in, buf.as_mut_ptr().cast(), room, *off) };
            if n > 0 {
                *off += n as i64;
            }
            n
        }
    };
    if n < 0 {
        return Err(real::errno());
    }
    c.send(&[IoSlice::new(&buf[..n as usize])], libc::MSG_NOSIGNAL)
}

/// splice from a ring into a pipe or file: never more than fits there.
///
/// # Safety
/// `off_out` must be null or point to a readable, writable `loff_t`.
unsafe fn splice_from_ring(
    c: &Conn,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    nonblock: bool,
) -> Result<usize, c_int> {
    let room = real::pipe_room(fd_out).unwrap_or(65536).min(len).max(1);
    let mut buf = vec![0u8; room];
    let f = if nonblock { libc::MSG_DONTWAIT } else { 0 };
    let n = c.recv(&mut [IoSliceMut::new(&mut buf)], f)?;
    // SAFETY: null or a valid loff_t, by the contract.
    let w = match unsafe { off_out.as_mut() } {
        // SAFETY: `buf` holds `n` <= `room` received bytes.
        None => unsafe { real::write()(fd_out, buf.as_ptr().cast(), n) },
        Some(off) => {
            // SAFETY: as above.
            let w = unsafe { libc::pwrite64(fd_out, buf.as_ptr().cast(), n, *off) };
            if w > 0 {
                *off += w as i64;
            }
            w
        }
    };
    if w < 0 {
        return Err(real::errno());
    }
    Ok(w as usize)
}

/// The connection behind a splice end that our code must carry: on its ring, or coming back
/// to it. A switched connection on TCP stays there (the kernel moves bytes our counts miss) —
/// unless a promotion is past its point of no return: that is finished first.
fn spliced(fd: c_int) -> Option<std::sync::Arc<Conn>> {
    match dispatch::route(fd) {
        Route::Ring(c) => Some(c),
        Route::Switched(c) if c.path() == crate::conn::Path::Tcp => {
            if c.pin_to_tcp("splice") {
                return None;
            }
            c.complete_promotion();
            Some(c)
        }
        Route::Switched(c) => Some(c),
        _ => {
            crate::late::taint(fd, "splice");
            None
        }
    }
}

hook! {
    /// splice with a ring connection on one side: the pipe or file side is read or written
    /// for real, the connection side through the ring.
    fn splice(
        fd_in: c_int,
        off_in: *mut libc::loff_t,
        fd_out: c_int,
        off_out: *mut libc::loff_t,
        n: size_t,
        flags: libc::c_uint,
    ) -> ssize_t;
    real kernel = real::splice,
        pass if table::kind(fd_in) != table::K_OBJ && table::kind(fd_out) != table::K_OBJ;
    on_panic fail(libc::EIO);
    {
        let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
        let (fin, fout) = (spliced(fd_in), spliced(fd_out));
        let r = match (fin, fout) {
            // SAFETY: splice's contract: `off_in` is null or a valid loff_t.
            (_, Some(c)) => unsafe { splice_into_ring(&c, fd_in, off_in, n, nonblock) }
                .map(len),
            // SAFETY: splice's contract: `off_out` is null or a valid loff_t.
            (Some(c), _) => unsafe { splice_from_ring(&c, fd_out, off_out, n, nonblock) }
                .map(len),
            _ => return Ok(kernel()),
        };
        match r {
            // Left its ring during the call with nothing moved: the kernel splices.
            Err(SWITCHED) => Ok(kernel()),
            r => r,
        }
    }
}

/// Whether a message carries control data (cheap: the header only).
///
/// # Safety
/// `msg` must be null or point to a readable msghdr.
unsafe fn has_control(msg: *const libc::msghdr) -> bool {
    // SAFETY: the caller's contract.
    unsafe { msg.as_ref() }.is_some_and(|m| m.msg_controllen > 0 && !m.msg_control.is_null())
}

/// Whether any of `n` message headers carries control data.
///
/// # Safety
/// `msgs` must be null or point to `n` readable mmsghdrs.
unsafe fn any_control(msgs: *const libc::mmsghdr, n: libc::c_uint) -> bool {
    !msgs.is_null()
        // SAFETY: the caller's contract: `n` readable headers.
        && (0..n as usize).any(|i| unsafe { has_control(&(*msgs.add(i)).msg_hdr) })
}

/// The fds the first `n` of a batch of messages pass with `SCM_RIGHTS`.
///
/// # Safety
/// `msgs` must be null or point to `n` readable mmsghdrs whose control buffers are valid
/// for their `msg_controllen` bytes.
unsafe fn passed_fds_mmsg(msgs: *const libc::mmsghdr, n: libc::c_uint) -> Vec<c_int> {
    if msgs.is_null() {
        return Vec::new();
    }
    (0..n as usize)
        // SAFETY: the caller's contract, header by header.
        .flat_map(|i| unsafe { passed_fds(&(*msgs.add(i)).msg_hdr) })
        .collect()
}

/// The fds an `SCM_RIGHTS` message passes.
///
/// # Safety
/// `msg` must be null or point to a readable msghdr whose control buffer is valid for
/// `msg_controllen` bytes.
unsafe fn passed_fds(msg: *const libc::msghdr) -> Vec<c_int> {
    let mut out = Vec::new();
    // SAFETY: the caller's contract.
    if !unsafe { has_control(msg) } {
        return out;
    }
    // SAFETY: a valid msghdr with a valid control buffer (the caller's contract); the CMSG
    // macros stay within `msg_controllen`.
    unsafe {
        let mut cm = libc::CMSG_FIRSTHDR(msg);
        while !cm.is_null() {
            let h = &*cm;
            if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cm) as *const c_int;
                let n = (h.cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<c_int>();
                out.extend((0..n).map(|i| data.add(i).read_unaligned()));
            }
            cm = libc::CMSG_NXTHDR(msg, cm);
        }
    }
    out
}

/// Whether a send on `fd` may be ours: a connection or UDP socket of ours, or a UDP socket
/// not published yet (its first datagram to a member's socket publishes it).
fn ours_to_send(fd: c_int) -> bool {
    matches!(table::kind(fd), table::K_OBJ | table::K_UDP)
}

/// `sendmsg` of a datagram on a UDP socket of ours: `None` when it is the kernel's (control
/// data, a connection, or no member at the destination).
///
/// # Safety
/// `msg` must be null or a readable msghdr with valid name and iovecs.
unsafe fn send_datagram_msg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> Option<ssize_t> {
    // SAFETY: the caller's contract.
    if unsafe { has_control(msg) } {
        if let Some(u) = datagram::udp(fd) {
            // SAFETY: the caller's contract.
            u.sent_by_kernel(unsafe { msg.as_ref().and_then(|m| datagram::msg_dst(m)) });
        }
        return None;
    }
    if !datagram::may_send(fd) {
        return None;
    }
    // SAFETY: the caller's contract.
    let m = unsafe { msg.as_ref() }?;
    // SAFETY: the caller's contract: `msg_iov` holds `msg_iovlen` readable iovecs.
    let bufs = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) };
    let parts: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
    // SAFETY: the caller's contract for the name.
    datagram::send(fd, &parts, flags, unsafe { datagram::msg_dst(m) })
}
