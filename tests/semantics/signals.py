#!/usr/bin/env python3
"""Signals and blocking calls beyond recv (see fdctl.py for recv):
  sigmask_waits  ppoll, pselect and epoll_pwait on a connection install their signal mask: a
                 signal blocked in the thread but not in the call's mask interrupts the wait
                 (EINTR) — through the C calls, since Python retries on EINTR;
  eintr_send     a send blocked on a full connection: EINTR without SA_RESTART, and with
                 SA_RESTART it continues and completes once the peer reads."""

import ctypes
import errno
import signal
import socket
import threading
import time

from semlib import (LIBC, check, cmd, command_server, dial, eq, fill, libc_errno, now, pattern,
                    recv_all, recv_exact, run, serve_one, within)


def commands(conn, args):
    command_server(conn)


class PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


SIGSET = ctypes.c_ubyte * 128  # sigset_t; all zero: the empty set


def kill_me_later(seconds, sig=signal.SIGUSR1):
    me = threading.get_ident()
    t = threading.Timer(seconds, lambda: signal.pthread_kill(me, sig))
    t.daemon = True
    t.start()


def interrupted(name, fn):
    """fn() must return -1/EINTR about 0.3 s after it started (when the signal comes)."""
    t0 = now()
    kill_me_later(0.3)
    r = fn()
    e = libc_errno()
    eq((r, errno.errorcode.get(e, e)), (-1, "EINTR"), f"{name} interrupted through its mask")
    within(now() - t0, 0.2, 1.5, f"{name} returned when the signal came")
    time.sleep(0.01)  # let the Python-level handler run


def sigmask_client(args):
    s = dial(args)
    fd = s.fileno()
    hits = []
    signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    empty = SIGSET()
    ts = Timespec(3, 0)

    pfd = (PollFd * 1)(PollFd(fd, 1, 0))  # POLLIN
    LIBC.ppoll.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p]
    interrupted("ppoll", lambda: LIBC.ppoll(pfd, 1, ctypes.byref(ts), empty))

    rset = (ctypes.c_ulong * 16)()
    rset[fd // 64] |= 1 << (fd % 64)
    LIBC.pselect.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p]
    interrupted("pselect", lambda: LIBC.pselect(fd + 1, rset, None, None, ctypes.byref(ts),
                                                empty))

    import select

    ep = select.epoll()
    ep.register(fd, select.EPOLLIN)
    evbuf = ctypes.create_string_buffer(12 * 4)
    LIBC.epoll_pwait.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p]
    interrupted("epoll_pwait", lambda: LIBC.epoll_pwait(ep.fileno(), evbuf, 4, 3000, empty))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
    time.sleep(0.01)
    eq(len(hits), 3, "handler calls")

    # The waits still work afterwards.
    cmd(s, "send 4 901")
    pfd[0].revents = 0
    eq(LIBC.ppoll(pfd, 1, ctypes.byref(ts), empty), 1, "ppoll with data")
    eq(pfd[0].revents & 1, 1, "POLLIN from ppoll")
    eq(LIBC.epoll_pwait(ep.fileno(), evbuf, 4, 3000, empty), 1, "epoll_pwait with data")
    eq(recv_exact(s, 4), pattern(4, 901), "data")
    ep.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


def eintr_send_client(args):
    s = dial(args)
    fd = s.fileno()
    hits = []
    signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    cmd(s, "ping")
    eq(recv_exact(s, 5), b"pong\n", "pong")
    cmd(s, "sleep 1000")
    cmd(s, "sink")
    time.sleep(0.1)
    total = fill(s, 902)
    chunk = pattern(65536, 903)
    buf = ctypes.create_string_buffer(chunk, len(chunk))

    signal.siginterrupt(signal.SIGUSR1, True)
    t0 = now()
    kill_me_later(0.3)
    r = LIBC.send(fd, buf, len(chunk), 0)
    e = libc_errno()
    eq((r, errno.errorcode.get(e, e)), (-1, "EINTR"), "blocked send without SA_RESTART")
    within(now() - t0, 0.2, 1.0, "EINTR came with the signal")

    signal.siginterrupt(signal.SIGUSR1, False)
    total += fill(s, 904)  # the kernel may have found room meanwhile
    t0 = now()
    kill_me_later(0.3)
    r = LIBC.send(fd, buf, len(chunk), 0)
    eq(r, len(chunk), f"blocked send with SA_RESTART (errno {libc_errno()})")
    check(now() - t0 > 0.5, "the restarted send waited for the peer")
    time.sleep(0.01)
    eq(len(hits), 2, "handler calls")
    s.shutdown(socket.SHUT_WR)
    reply = recv_all(s).decode().split()
    eq(reply[:2], ["got", str(total + len(chunk))], "what the server sank")
    s.close()


CASES = {
    "sigmask_waits": (serve_one(commands), sigmask_client),
    "eintr_send": (serve_one(commands), eintr_send_client),
}

if __name__ == "__main__":
    run(CASES)
