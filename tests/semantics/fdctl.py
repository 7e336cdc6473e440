#!/usr/bin/env python3
"""File-descriptor control: O_NONBLOCK toggling (fcntl and FIONBIO, shared by dups), the dup
family (F_DUPFD, dup, dup2, dup3; close of the original keeps the connection; dup2 over another
connection closes that one), SO_RCVTIMEO/SO_SNDTIMEO, EINTR vs SA_RESTART, errno left as it
was by every call that succeeds, and a program closing every fd it did not open (the library's
liveness lock among them)."""

import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from semlib import (LIBC, Fail, check, cmd, command_server, dial, eq, libc_errno, now, pattern,
                    recv_exact, run, serve_commands_n, serve_one, within)


def commands(conn, args):
    command_server(conn)


def expect_eagain(fn, what):
    t0 = now()
    try:
        fn()
        raise Fail(f"{what}: no EAGAIN")
    except BlockingIOError:
        pass
    within(now() - t0, 0, 0.5, f"{what}: EAGAIN at once")


def read_exact_fd(fd, n):
    out = b""
    while len(out) < n:
        b = os.read(fd, n - len(out))
        check(b, f"EOF after {len(out)} of {n} bytes")
        out += b
    return out


# ---- nonblock_toggle ---------------------------------------------------------------------------

def nonblock_client(args):
    s = dial(args)
    fd = s.fileno()
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    check(not fl & os.O_NONBLOCK, "a fresh connection is non-blocking")
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
    check(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK, "F_GETFL after setting O_NONBLOCK")
    expect_eagain(lambda: os.read(fd, 10), "read with O_NONBLOCK")
    buf = ctypes.create_string_buffer(16)
    eq((LIBC.recv(fd, buf, 16, 0), libc_errno()), (-1, errno.EAGAIN), "recv with O_NONBLOCK")
    fcntl.fcntl(fd, fcntl.F_SETFL, fl)
    t0 = now()
    cmd(s, "send 5 91 300")
    eq(read_exact_fd(fd, 5), pattern(5, 91), "blocking read after clearing O_NONBLOCK")
    within(now() - t0, 0.2, 5, "the read blocked until the data came")
    # FIONBIO (what Python's setblocking uses).
    s.setblocking(False)
    expect_eagain(lambda: s.recv(10), "recv after FIONBIO on")
    s.setblocking(True)
    t0 = now()
    cmd(s, "send 5 92 300")
    eq(recv_exact(s, 5), pattern(5, 92), "blocking recv after FIONBIO off")
    within(now() - t0, 0.2, 5, "the recv blocked until the data came")
    # The flag belongs to the open file: set through a dup, seen through the original.
    d = os.dup(fd)
    fcntl.fcntl(d, fcntl.F_SETFL, fcntl.fcntl(d, fcntl.F_GETFL) | os.O_NONBLOCK)
    check(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK, "O_NONBLOCK set on a dup")
    expect_eagain(lambda: os.read(fd, 10), "read on the original after O_NONBLOCK on a dup")
    fcntl.fcntl(fd, fcntl.F_SETFL, fl)
    t0 = now()
    cmd(s, "send 5 93 300")
    eq(read_exact_fd(d, 5), pattern(5, 93), "blocking read on the dup after clearing")
    within(now() - t0, 0.2, 5, "the dup's read blocked until the data came")
    os.close(d)
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- dup_family ------------------------------------------------------------------------------

def ping(wfd, rfd, what):
    os.write(wfd, b"ping\n")
    eq(read_exact_fd(rfd, 5), b"pong\n", what)


def dup_client(args):
    c1 = dial(args)
    c2 = dial(args)
    # Both connections in use first (so both are settled, on rings under the preload).
    for c in (c1, c2):
        cmd(c, "ping")
        eq(recv_exact(c, 5), b"pong\n", "pong")
    fd = c1.detach()
    d1 = fcntl.fcntl(fd, fcntl.F_DUPFD, 100)
    check(d1 >= 100, f"F_DUPFD returned {d1}")
    d2 = os.dup(fd)  # F_DUPFD_CLOEXEC
    pr, pw = os.pipe()
    os.dup2(fd, pr)  # dup2 over an unrelated open fd
    d4 = os.dup2(fd, 200, inheritable=False)  # dup3(O_CLOEXEC)
    eq(d4, 200, "dup3 target")
    os.write(d1, b"send 7 94\n")
    eq(read_exact_fd(d2, 7), pattern(7, 94), "written via F_DUPFD, read via dup")
    ping(pr, d4, "written via the dup2 target, read via dup3")
    os.close(fd)
    ping(d1, d2, "after closing the original")
    os.close(d1)
    os.close(d2)
    os.close(pr)
    ping(d4, d4, "through the last dup")
    # dup2 over the other connection closes it (the server sees EOF there) and aliases c1.
    c2fd = c2.detach()
    os.dup2(d4, c2fd)
    ping(c2fd, d4, "via the fd that was the other connection")
    os.close(c2fd)
    os.write(d4, b"close\n")
    eq(os.read(d4, 10), b"", "EOF")
    os.close(d4)
    os.close(pw)


# ---- timeouts ----------------------------------------------------------------------------------

def timeval(sec):
    return struct.pack("ll", int(sec), int((sec % 1) * 1e6))


def timeo_client(args):
    s = dial(args)
    fd = s.fileno()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(0.25))
    for what, fn in [("recv", lambda: s.recv(10)), ("read", lambda: os.read(fd, 10))]:
        t0 = now()
        try:
            fn()
            raise Fail(f"{what} with SO_RCVTIMEO returned")
        except BlockingIOError:
            pass
        within(now() - t0, 0.2, 1.5, f"{what} gave up after SO_RCVTIMEO")
    # The data comes 20 ms later: well within the 250 ms timeout even on a loaded machine.
    cmd(s, "send 5 95 20")
    eq(recv_exact(s, 5), pattern(5, 95), "data within SO_RCVTIMEO")
    # SO_SNDTIMEO: the server sleeps; a big send returns short, the next one EAGAIN.
    cmd(s, "ping")
    eq(recv_exact(s, 5), b"pong\n", "pong")
    cmd(s, "sleep 2000")
    cmd(s, "sink")
    time.sleep(0.1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(0.25))
    big = pattern(16 << 20, 96)
    n = 0
    for i in range(10):
        t0 = now()
        try:
            n += s.send(big[n:])
            check(n < len(big), "16 MB went into a connection whose reader sleeps")
        except BlockingIOError:
            within(now() - t0, 0.2, 1.5, "a send on a full connection gave up after SO_SNDTIMEO")
            break
        # A send that got some bytes in returns them once SO_SNDTIMEO expires.
        within(now() - t0, 0.2, 1.5, f"send {i} returned short after SO_SNDTIMEO")
    else:
        raise Fail("sends with SO_SNDTIMEO never failed with EAGAIN")
    check(n > 0, "nothing was sent")
    s.shutdown(socket.SHUT_WR)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(10))
    reply = recv_exact(s, 4).decode() + s.recv(200).decode()
    eq(reply.split()[:2], ["got", str(n)], "what the server sank")
    s.close()


# ---- eintr ---------------------------------------------------------------------------------------

class Interrupted(Exception):
    pass


def kill_me_later(seconds, sig=signal.SIGUSR1):
    me = threading.get_ident()
    t = threading.Timer(seconds, lambda: signal.pthread_kill(me, sig))
    t.daemon = True
    t.start()


def eintr_client(args):
    s = dial(args)
    fd = s.fileno()
    hits = []
    signal.signal(signal.SIGUSR1, lambda *_: hits.append(now()))
    buf = ctypes.create_string_buffer(64)

    # Without SA_RESTART: the blocking recv fails with EINTR.
    signal.siginterrupt(signal.SIGUSR1, True)
    t0 = now()
    kill_me_later(0.3)
    r = LIBC.recv(fd, buf, 64, 0)
    e = libc_errno()
    eq((r, errno.errorcode.get(e, e)), (-1, "EINTR"), "recv interrupted without SA_RESTART")
    within(now() - t0, 0.2, 1.5, "EINTR came with the signal")
    time.sleep(0.01)
    eq(len(hits), 1, "handler calls")

    # The Python view: the handler's exception comes out of the blocked recv.
    def raiser(*_):
        raise Interrupted()

    signal.signal(signal.SIGUSR1, raiser)
    signal.siginterrupt(signal.SIGUSR1, True)
    t0 = now()
    kill_me_later(0.3)
    try:
        s.recv(64)
        raise Fail("recv returned although interrupted")
    except Interrupted:
        pass
    within(now() - t0, 0.2, 1.5, "the handler's exception came with the signal")

    # With SA_RESTART: the recv continues and gets the data that comes later.
    signal.signal(signal.SIGUSR1, lambda *_: hits.append(now()))
    signal.siginterrupt(signal.SIGUSR1, False)
    t0 = now()
    cmd(s, "send 5 97 600")
    kill_me_later(0.3)
    r = LIBC.recv(fd, buf, 64, 0)
    eq(r, 5, f"recv with SA_RESTART (errno {libc_errno()})")
    eq(buf.raw[:5], pattern(5, 97), "data after the restarted recv")
    within(now() - t0, 0.5, 3, "the restarted recv waited for the data")
    time.sleep(0.01)
    eq(len(hits), 2, "handler calls")

    # With SO_RCVTIMEO the kernel never restarts: EINTR even with SA_RESTART.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(3))
    t0 = now()
    kill_me_later(0.3)
    r = LIBC.recv(fd, buf, 64, 0)
    e = libc_errno()
    eq((r, errno.errorcode.get(e, e)), (-1, "EINTR"), "recv with SO_RCVTIMEO and SA_RESTART")
    within(now() - t0, 0.2, 1.5, "EINTR came with the signal")
    cmd(s, "close")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(0))
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- errno_kept: a call that succeeds leaves errno alone ---------------------------------------
# The kernel's calls never touch errno when they succeed, and C programs rely on it: sockperf
# reads errno after a recv that returned data and takes EPIPE/ECONNRESET there for a dead peer.
# So the library's own calls that fail on the way (futex sleeps that time out, doorbell drains
# that end in EAGAIN, wake-ups that find nobody) must not show through a call that succeeds.

SENTINEL = errno.ENOTRECOVERABLE  # no socket call sets it


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _EpollEvent(ctypes.Structure):
    _pack_ = 1  # x86-64's struct epoll_event is packed
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def kept(what, call):
    """Runs `call` with errno at SENTINEL: it must succeed and leave SENTINEL there."""
    ctypes.set_errno(SENTINEL)
    r = call()
    e = libc_errno()
    check(r >= 0, f"{what} failed (errno {e})")
    eq(e, SENTINEL, f"errno after a successful {what} (-1 results aside, it must not change)")
    return r


def errno_client(args):
    s = dial(args)
    fd = s.fileno()
    buf = ctypes.create_string_buffer(1 << 16)
    # A blocking recv that has to sleep until the data comes.
    cmd(s, "send 64 1 150")
    eq(kept("blocking recv", lambda: LIBC.recv(fd, buf, 64, socket.MSG_WAITALL)), 64, "recv")
    eq(buf.raw[:64], pattern(64, 1), "the bytes the blocking recv got")
    # poll that sleeps, then a recv that does not.
    cmd(s, "send 32 2 150")
    pfd = _PollFd(fd, select.POLLIN, 0)
    eq(kept("poll", lambda: LIBC.poll(ctypes.byref(pfd), 1, 5000)), 1, "poll's count")
    eq(kept("MSG_DONTWAIT recv", lambda: LIBC.recv(fd, buf, 32, socket.MSG_DONTWAIT)), 32, "n")
    # epoll_wait that sleeps.
    ep = kept("epoll_create1", lambda: LIBC.epoll_create1(0))
    ev = _EpollEvent(select.EPOLLIN, fd)
    kept("epoll_ctl ADD", lambda: LIBC.epoll_ctl(ep, 1, fd, ctypes.byref(ev)))
    cmd(s, "send 16 3 150")
    evs = (_EpollEvent * 8)()
    eq(kept("epoll_wait", lambda: LIBC.epoll_wait(ep, evs, 8, 5000)), 1, "epoll_wait's count")
    eq(kept("recv after epoll", lambda: LIBC.recv(fd, buf, 16, 0)), 16, "n")
    # select that sleeps (fd_set: 1024 bits).
    cmd(s, "send 8 4 150")
    rset = (ctypes.c_ulong * 16)()
    rset[fd // 64] |= 1 << (fd % 64)
    eq(kept("select", lambda: LIBC.select(fd + 1, rset, None, None, None)), 1, "select's count")
    eq(kept("recv after select", lambda: LIBC.recv(fd, buf, 8, 0)), 8, "n")
    # Sends that fill the ring and wait for the reader to make room.
    data = pattern(4 << 20, 5)
    cmd(s, f"expect {len(data)} 5")
    view = ctypes.create_string_buffer(data, len(data))
    sent = 0
    while sent < len(data):
        n = min(len(data) - sent, 1 << 16)
        sent += kept("send", lambda: LIBC.send(fd, ctypes.byref(view, sent), n, 0))
    eq(kept("recv of ok", lambda: LIBC.recv(fd, buf, 3, socket.MSG_WAITALL)), 3, "n")
    eq(buf.raw[:3], b"ok\n", "the server's answer")
    # Bookkeeping calls.
    one = ctypes.c_int(1)
    size = ctypes.c_uint32(4)
    kept("setsockopt", lambda: LIBC.setsockopt(fd, socket.IPPROTO_TCP, socket.TCP_NODELAY,
                                               ctypes.byref(one), 4))
    kept("getsockopt", lambda: LIBC.getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_NODELAY,
                                               ctypes.byref(one), ctypes.byref(size)))
    kept("ioctl FIONREAD", lambda: LIBC.ioctl(fd, 0x541B, ctypes.byref(one)))
    kept("fcntl F_GETFL", lambda: LIBC.fcntl(fd, fcntl.F_GETFL))
    d = kept("dup", lambda: LIBC.dup(fd))
    kept("close of a dup", lambda: LIBC.close(d))
    # fork with a ring connection open (the library's fork handlers run): both sides.
    pid = kept("fork", LIBC.fork)
    if pid == 0:
        os._exit(0 if libc_errno() == SENTINEL else 3)
    _, status = os.waitpid(pid, 0)
    eq(os.waitstatus_to_exitcode(status), 0, "the fork child's errno was left alone (exit 0)")
    # End of stream is a success too.
    cmd(s, "close")
    eq(kept("recv at EOF", lambda: LIBC.recv(fd, buf, 16, 0)), 0, "recv at EOF")
    kept("epoll_ctl DEL", lambda: LIBC.epoll_ctl(ep, 2, fd, None))
    kept("close of the epoll set", lambda: LIBC.close(ep))
    kept("close", lambda: LIBC.close(s.detach()))


# ---- closerange: the library's liveness lock closed by the program -----------------------------

def under_preload():
    if not os.environ.get("MEMLOOP_BIN") or not os.environ.get("MEMLOOP_REGION"):
        return False
    with open("/proc/self/maps") as f:
        return "/libmemloop" in f.read()


def my_member():
    """This process's member in `memloop status --json` (run without the library)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MEMLOOP_LOG")}
    out = subprocess.run([os.environ["MEMLOOP_BIN"], "status", "--json"], env=env,
                         capture_output=True, check=True, timeout=20)
    mine = [m for m in json.loads(out.stdout)["members"] if m["pid"] == os.getpid()]
    return mine[0] if mine else None


def closerange_client(args):
    # A datagram to a port nobody serves makes us a member holding nothing: no heartbeat
    # thread, alive by /proc and by our lock.
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.sendto(b"x", ("127.0.0.1", 9))
    u.close()
    under = under_preload()
    if under:
        m = my_member()
        check(m is not None and m["lock"] and not m["beating"] and m["alive"],
              f"a member holding nothing: {m}")
    # What daemons do after start-up: close everything but stdio.
    os.closerange(3, 65536)
    if under:
        m = my_member()
        check(m is not None and not m["lock"] and m["beating"] and m["alive"],
              f"after the program closed the lock, the member must beat: {m}")
        beat = m["heartbeat"]
        time.sleep(0.7)
        m = my_member()
        check(m is not None and m["heartbeat"] != beat and m["alive"],
              f"its heartbeat must move: {beat} then {m}")
        print("closerange: the lock went, the member beats", file=sys.stderr)
    c = dial(args)
    cmd(c, "ping")
    eq(recv_exact(c, 5), b"pong\n", "pong after the closerange")
    cmd(c, "close")
    eq(c.recv(10), b"", "EOF")
    c.close()


CASES = {
    "nonblock_toggle": (serve_one(commands), nonblock_client),
    "dup_family": (serve_commands_n(2), dup_client),
    "sockopt_timeouts": (serve_one(commands), timeo_client),
    "eintr": (serve_one(commands), eintr_client),
    "errno_kept": (serve_one(commands), errno_client),
    "closerange": (serve_one(commands), closerange_client),
}

if __name__ == "__main__":
    run(CASES)
