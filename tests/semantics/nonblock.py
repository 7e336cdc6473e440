#!/usr/bin/env python3
"""Non-blocking sockets: connect in progress + POLLOUT + SO_ERROR (poll, epoll registered before
connect, select), EAGAIN reads, accept4 with SOCK_NONBLOCK|SOCK_CLOEXEC."""

import ctypes
import errno
import fcntl
import os
import select
import socket
import time

from semlib import (LIBC, Fail, check, cmd, command_server, dial, eq, libc_errno, now, pattern,
                    poll1, recv_exact, run, serve_commands_n, serve_one, within)


def nb_connect_one(args, waiter, seed):
    fam = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setblocking(False)
    ep = None
    if waiter == "epoll":
        # Registered before connect: the registration must follow the connection.
        ep = select.epoll()
        ep.register(s.fileno(), select.EPOLLOUT)
    r = s.connect_ex((args.host, args.port))
    check(r in (0, errno.EINPROGRESS), f"non-blocking connect returned {errno.errorcode.get(r, r)}")
    if waiter == "poll":
        ev = poll1(s, select.POLLOUT, 5000)
        check(ev & select.POLLOUT, f"poll never reported POLLOUT (revents {ev:#x})")
        check(not ev & (select.POLLERR | select.POLLHUP), f"poll reported an error: {ev:#x}")
    elif waiter == "epoll":
        evs = ep.poll(5)
        check(evs, "epoll never reported the connected socket")
        eq(evs[0][0], s.fileno(), "epoll event fd")
        check(evs[0][1] & select.EPOLLOUT, f"epoll events {evs[0][1]:#x} lack EPOLLOUT")
        check(not evs[0][1] & (select.EPOLLERR | select.EPOLLHUP), f"epoll error {evs[0][1]:#x}")
    else:
        _, w, _ = select.select([], [s], [], 5)
        eq(w, [s], "select writable set after connect")
    eq(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), 0, "SO_ERROR after connect")
    check(s.getpeername()[1] == args.port, "getpeername after a non-blocking connect")
    cmd(s, f"send 1000 {seed}")
    check(poll1(s, select.POLLIN, 5000) & select.POLLIN, "reply never readable")
    got = b""
    while len(got) < 1000:
        check(poll1(s, select.POLLIN, 5000) & select.POLLIN, "reply stalled")
        got += s.recv(1000 - len(got))
    eq(got, pattern(1000, seed), "reply on the non-blocking connection")
    if ep is not None:
        # Writable and (now) no data: level-triggered EPOLLOUT only.
        evs = ep.poll(0)
        eq([(f, e & (select.EPOLLIN | select.EPOLLOUT)) for f, e in evs],
           [(s.fileno(), select.EPOLLOUT)], "epoll after draining")
        ep.close()
    return s


def nb_connect_client(args):
    socks = [nb_connect_one(args, w, 20 + i) for i, w in enumerate(["poll", "epoll", "select"])]
    for s in socks:
        cmd(s, "close")
        s.setblocking(True)
        eq(s.recv(10), b"", "EOF")
        s.close()


def nb_read_client(args):
    s = dial(args)
    s.setblocking(False)  # ioctl(FIONBIO)
    t0 = now()
    try:
        s.recv(10)
        raise Fail("recv on an empty non-blocking socket did not raise EAGAIN")
    except BlockingIOError:
        pass
    try:
        os.read(s.fileno(), 10)
        raise Fail("read() on an empty non-blocking socket did not raise EAGAIN")
    except BlockingIOError:
        pass
    within(now() - t0, 0, 0.5, "EAGAIN came at once")
    t0 = now()
    cmd(s, "send 10 12 200")
    check(poll1(s, select.POLLIN, 5000) & select.POLLIN, "data never became readable")
    within(now() - t0, 0.15, 5, "poll waited for the delayed data")
    eq(s.recv(100), pattern(10, 12), "data")
    try:
        s.recv(10)
        raise Fail("second recv did not raise EAGAIN")
    except BlockingIOError:
        pass
    cmd(s, "close")
    check(poll1(s, select.POLLIN, 5000) & select.POLLIN, "EOF never readable")
    eq(s.recv(10), b"", "EOF")
    s.close()


def accept4_server(lsock, args):
    lfd = lsock.fileno()
    fd1 = LIBC.accept4(lfd, None, None, socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    check(fd1 >= 0, f"accept4 failed: errno {libc_errno()}")
    fd2 = LIBC.accept4(lfd, None, None, 0)
    check(fd2 >= 0, f"accept4 failed: errno {libc_errno()}")
    lsock.close()
    check(fcntl.fcntl(fd1, fcntl.F_GETFL) & os.O_NONBLOCK, "SOCK_NONBLOCK not in F_GETFL")
    check(fcntl.fcntl(fd1, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "SOCK_CLOEXEC not in F_GETFD")
    check(not fcntl.fcntl(fd2, fcntl.F_GETFL) & os.O_NONBLOCK, "plain accept4 is non-blocking")
    check(not fcntl.fcntl(fd2, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "plain accept4 is cloexec")
    buf = ctypes.create_string_buffer(64)
    t0 = now()
    r = LIBC.recv(fd1, buf, 64, 0)
    eq((r, libc_errno()), (-1, errno.EAGAIN), "recv on the SOCK_NONBLOCK connection")
    within(now() - t0, 0, 0.5, "EAGAIN came at once")
    os.write(fd1, b"ready1\n")
    os.write(fd2, b"ready2\n")
    check(poll1(fd1, select.POLLIN, 5000) & select.POLLIN, "client data never readable")
    eq(os.read(fd1, 64), b"data1", "data on the non-blocking connection")
    t0 = now()
    eq(os.read(fd2, 64), b"data2", "blocking read on the plain connection")
    within(now() - t0, 0.1, 5, "the blocking read waited")
    os.close(fd1)
    os.close(fd2)


def accept4_client(args):
    c1 = dial(args)
    c2 = dial(args)
    eq(recv_exact(c1, 7), b"ready1\n", "greeting 1")
    eq(recv_exact(c2, 7), b"ready2\n", "greeting 2")
    c1.sendall(b"data1")
    import time

    time.sleep(0.3)
    c2.sendall(b"data2")
    eq(c1.recv(10), b"", "EOF 1")
    eq(c2.recv(10), b"", "EOF 2")
    c1.close()
    c2.close()


GREET_WAITS = ("recv", "poll", "select", "epoll", "epoll_et")


def greet_server(lsock, args):
    """Accepts late (the client already sleeps for the decision), then speaks first."""
    for _ in GREET_WAITS:
        time.sleep(0.2)
        conn, _ = lsock.accept()
        conn.sendall(b"hello\n")
        eq(recv_exact(conn, 3), b"bye", "the client's answer")
        conn.close()
    lsock.close()


def greet_client(args):
    """A server that speaks first, the client asleep in each kind of wait while the server
    has not accepted yet: the accept must wake it (a doorbell for a wait in the kernel)."""
    for how in GREET_WAITS:
        s = dial(args)
        t0 = now()
        if how == "poll":
            check(poll1(s, select.POLLIN, 5000) & select.POLLIN, "poll: the greeting never came")
        elif how == "select":
            check(select.select([s], [], [], 5)[0], "select: the greeting never came")
        elif how.startswith("epoll"):
            ep = select.epoll()
            ep.register(s.fileno(), select.EPOLLIN | (select.EPOLLET if how == "epoll_et" else 0))
            check(ep.poll(5), f"{how}: the greeting never came")
            ep.close()
        eq(recv_exact(s, 6), b"hello\n", f"the greeting ({how})")
        within(now() - t0, 0, 1.5, f"the greeting came with the accept ({how})")
        s.sendall(b"bye")
        eq(s.recv(10), b"", f"EOF ({how})")
        s.close()


CASES = {
    "greet": (greet_server, greet_client),
    "nb_connect": (serve_commands_n(3), nb_connect_client),
    "nb_read": (serve_one(lambda c, a: command_server(c)), nb_read_client),
    "accept4_flags": (accept4_server, accept4_client),
}

if __name__ == "__main__":
    run(CASES)
