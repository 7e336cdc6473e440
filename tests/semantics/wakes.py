#!/usr/bin/env python3
"""Wake-ups: a side that sleeps in each kind of wait is woken when its peer writes.

Every case is an echo of ROUNDS small messages; the client pauses PAUSE seconds before each
one, so the server is asleep (past any spin) when it comes, and the client then sleeps in the
same kind of wait for the echo. Kinds: a blocking recv (no timeout, SO_RCVTIMEO), poll,
select, epoll level-triggered, edge-triggered and one-shot (each with and without a timeout),
and a blocking recv interrupted by signals (a handler with SA_RESTART: the recv goes on; one
without: EINTR, as on TCP). Under the preload the harness also checks which wake-up path was
taken (the region's doorbell counters)."""

import os
import select
import signal
import socket
import struct
import threading
import time

from semlib import Fail, dial, eq, recv_exact, run, serve_one

ROUNDS = 40
PAUSE = 0.004
MSG = 48


def wait_readable(sock, kind, timeout):
    """Sleeps until `sock` is readable, in wait `kind`; returns when it is."""
    fd = sock.fileno()
    t = None if timeout is None else timeout
    if kind == "poll":
        p = select.poll()
        p.register(fd, select.POLLIN)
        while not p.poll(None if t is None else int(t * 1000)):
            pass
    elif kind == "select":
        while not select.select([sock], [], [], t)[0]:
            pass
    elif kind.startswith("epoll"):
        flags = {"epoll_lt": 0, "epoll_et": select.EPOLLET,
                 "epoll_oneshot": select.EPOLLONESHOT}[kind]
        ep = WAITSETS.setdefault(fd, select.epoll())
        if fd not in REGISTERED:
            ep.register(fd, select.EPOLLIN | flags)
            REGISTERED.add(fd)
        elif kind == "epoll_oneshot":
            ep.modify(fd, select.EPOLLIN | flags)
        while not ep.poll(-1 if t is None else t):
            pass
    else:
        raise Fail(f"unknown wait kind {kind}")


WAITSETS = {}
REGISTERED = set()


def read_msg(sock, kind, timeout):
    """One message, waiting in `kind` first (`recv`: the blocking call itself)."""
    if kind in ("recv", "recv_timeout"):
        return recv_exact(sock, MSG, "a message")
    got = b""
    while len(got) < MSG:
        wait_readable(sock, kind, timeout)
        try:
            b = sock.recv(MSG - len(got), socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue  # (edge-triggered: another look finds it)
        if not b:
            raise Fail("EOF in the middle of the echo")
        got += b
    return got


def parse(args):
    kind, _, timeout = (args.extra or "recv").partition(":")
    return kind, (float(timeout) if timeout else None)


def prepare(sock, kind):
    if kind == "recv_timeout":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 5, 0))


def echo_server(conn, args):
    kind, timeout = parse(args)
    prepare(conn, kind)
    for _ in range(ROUNDS):
        conn.sendall(read_msg(conn, kind, timeout))
    conn.close()


def echo_client(args):
    kind, timeout = parse(args)
    s = dial(args)
    prepare(s, kind)
    for i in range(ROUNDS):
        time.sleep(PAUSE)
        m = bytes([i % 251]) * MSG
        s.sendall(m)
        eq(read_msg(s, kind, timeout), m, f"echo {i} ({kind})")
    s.close()


# ---- signals: a blocking recv on the ring, interrupted --------------------------------------------

def signal_server(conn, args):
    """Waits for each request in a blocking recv while a timer interrupts it with SIGALRM,
    first with SA_RESTART (the recv goes on, as on TCP), then without (EINTR)."""
    hits = []
    signal.signal(signal.SIGALRM, lambda *_: hits.append(1))
    signal.siginterrupt(signal.SIGALRM, False)  # SA_RESTART
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    try:
        for _ in range(ROUNDS // 2):
            conn.sendall(recv_exact(conn, MSG, "a message (SA_RESTART)"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
    if not hits:
        raise Fail("the timer never fired during the SA_RESTART half")
    # Without SA_RESTART: the kernel ends a blocking recv with EINTR; Python's own recv retries
    # after running the handler (PEP 475), so the raw call is made with ctypes' libc.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    signal.siginterrupt(signal.SIGALRM, True)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    buf = ctypes.create_string_buffer(MSG)
    r = libc.recv(conn.fileno(), buf, MSG, 0)
    err = ctypes.get_errno()
    eq((r, err), (-1, 4), "a blocking recv interrupted without SA_RESTART: EINTR")
    conn.sendall(b"!")
    for _ in range(ROUNDS // 2):
        conn.sendall(recv_exact(conn, MSG, "a message (after EINTR)"))
    conn.close()


def signal_client(args):
    s = dial(args)
    for i in range(ROUNDS // 2):
        time.sleep(PAUSE * 3)  # several timer ticks while the server sleeps
        m = bytes([i]) * MSG
        s.sendall(m)
        eq(recv_exact(s, MSG, "an echo"), m, f"echo {i} (SA_RESTART)")
    eq(recv_exact(s, 1, "the EINTR mark"), b"!", "the server saw EINTR")
    for i in range(ROUNDS // 2):
        time.sleep(PAUSE)
        m = bytes([100 + i]) * MSG
        s.sendall(m)
        eq(recv_exact(s, MSG, "an echo"), m, f"echo {i} (after EINTR)")
    s.close()


# ---- the program closes the library's wake socket's number and reuses it ----------------------

def foreign_fd(mine):
    """The highest-numbered socket fd the program did not open (the library's wake socket)."""
    best = None
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:") and fd not in mine and (best is None or fd > best):
            best = fd
    return best


def reuse_server(conn, args):
    """Sleeps in poll (the library makes its wake socket), then closes the highest socket fd it
    did not open and puts a pipe with one byte in it at that number: the polls that follow
    must still be woken, and the library must never read the program's pipe."""
    for _ in range(4):
        conn.sendall(read_msg(conn, "poll", None))
    lsock_fd = int(args.extra_fds)
    ours = foreign_fd({conn.fileno(), lsock_fd})
    r, w = os.pipe()
    if ours is not None:
        os.close(ours)
        os.dup2(r, ours)
        os.write(w, b"P")
    for _ in range(ROUNDS - 4):
        conn.sendall(read_msg(conn, "poll", None))
    if ours is not None:
        os.set_blocking(ours, False)
        eq(os.read(ours, 10), b"P", "the program's pipe at the reused number kept its byte")
    conn.close()


def reuse_client(args):
    s = dial(args)
    for i in range(ROUNDS):
        time.sleep(PAUSE)
        m = bytes([i]) * MSG
        s.sendall(m)
        eq(read_msg(s, "recv", None), m, f"echo {i}")
    s.close()


def serve_reuse(lsock, args):
    conn, _ = lsock.accept()
    args.extra_fds = str(lsock.fileno())
    reuse_server(conn, args)


# ---- a writer asleep on a full ring ---------------------------------------------------------------

FILL = 8 << 20


def fill_server(conn, args):
    """Writes FILL bytes in blocking sends (the ring fills: the writer sleeps for room), in
    the wait kind of --extra for writability when it is not a blocking send."""
    kind, timeout = parse(args)
    chunk = bytes(range(256)) * 256
    sent = 0
    while sent < FILL:
        if kind == "send":
            conn.sendall(chunk)
            sent += len(chunk)
            continue
        conn.setblocking(False)
        try:
            sent += conn.send(chunk[:FILL - sent])
        except BlockingIOError:
            wait_writable(conn, kind, timeout)
    conn.setblocking(True)
    conn.shutdown(socket.SHUT_WR)
    eq(conn.recv(1), b"k", "the reader's ack")
    conn.close()


def wait_writable(sock, kind, timeout):
    if kind == "poll":
        p = select.poll()
        p.register(sock.fileno(), select.POLLOUT)
        p.poll(None if timeout is None else int(timeout * 1000))
    elif kind == "select":
        select.select([], [sock], [], timeout)
    else:
        ep = WAITSETS.setdefault(sock.fileno(), select.epoll())
        if sock.fileno() not in REGISTERED:
            ep.register(sock.fileno(), select.EPOLLOUT)
            REGISTERED.add(sock.fileno())
        ep.poll(-1 if timeout is None else timeout)


def fill_client(args):
    s = dial(args)
    got = 0
    while True:
        time.sleep(0.002)  # the writer fills the ring meanwhile and sleeps
        b = s.recv(256 << 10)
        if not b:
            break
        got += len(b)
    eq(got, FILL, "bytes received")
    s.sendall(b"k")
    s.close()


# ---- shutdown(SHUT_RD) by another thread ends a blocked recv ------------------------------------

def shut_server(conn, args):
    got = {}

    def reader():
        got["data"] = conn.recv(100)  # nothing comes: only the shutdown ends it

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.3)  # the reader is asleep by now (past any spin)
    conn.shutdown(socket.SHUT_RD)
    t.join(5)
    if t.is_alive():
        raise Fail("a recv blocked in another thread outlived shutdown(SHUT_RD)")
    eq(got.get("data"), b"", "the blocked recv after shutdown(SHUT_RD)")
    conn.sendall(b"d")
    conn.close()


def shut_client(args):
    s = dial(args)
    eq(recv_exact(s, 1, "the server's done"), b"d", "done")
    s.close()


CASES = {
    "shut_rd": (serve_one(shut_server), shut_client),
    "fill": (serve_one(fill_server), fill_client),
    "reuse": (serve_reuse, reuse_client),
    "echo": (serve_one(echo_server), echo_client),
    "signals": (serve_one(signal_server), signal_client),
}

if __name__ == "__main__":
    run(CASES)
