#!/usr/bin/env python3
"""Readiness: poll/select/epoll on connections (readable after the peer writes, writable when
there is space), POLLHUP/POLLRDHUP after the peer's shutdown or close, level- vs
edge-triggered epoll, EPOLLONESHOT, one fd in two epoll sets, connections mixed with a pipe and
a kernel socket in one wait, and timeouts."""

import os
import select
import socket
import threading
import time

from semlib import (Fail, check, cmd, command_server, dial, eq, fill, now, pattern, poll1,
                    recv_all, recv_exact, run, serve_one, within, with_thread)

IN, OUT, HUP, RDHUP, ERR = (select.POLLIN, select.POLLOUT, select.POLLHUP, select.POLLRDHUP,
                            select.POLLERR)
EIN, EOUT, EET, EONE, ERDHUP, EHUP = (select.EPOLLIN, select.EPOLLOUT, select.EPOLLET,
                                      select.EPOLLONESHOT, select.EPOLLRDHUP, select.EPOLLHUP)


def commands(conn, args):
    command_server(conn)


def delayed(seconds, fn, *a):
    t = threading.Timer(seconds, fn, a)
    t.daemon = True
    t.start()
    return t


# ---- poll_select_epoll: readable after the peer writes, writable at once ------------------------

def basic_client(args):
    s = dial(args)
    fd = s.fileno()
    eq(poll1(s, IN, 0), 0, "poll POLLIN on an idle connection")
    eq(select.select([s], [], [], 0)[0], [], "select readable on an idle connection")
    ep = select.epoll()
    ep.register(fd, EIN)
    eq(ep.poll(0), [], "epoll EPOLLIN on an idle connection")
    eq(poll1(s, OUT, 0), OUT, "poll POLLOUT on an idle connection")
    eq(select.select([], [s], [], 0)[1], [s], "select writable on an idle connection")
    ep.modify(fd, EIN | EOUT)
    eq(ep.poll(0), [(fd, EOUT)], "epoll EPOLLOUT on an idle connection")
    ep.modify(fd, EIN)

    t0 = now()
    cmd(s, "send 10 51 200")
    eq(poll1(s, IN, 3000), IN, "poll after the peer wrote")
    within(now() - t0, 0.15, 3, "poll waited for the data")
    eq(poll1(s, IN | OUT, 0), IN | OUT, "poll with data and space")
    eq(s.recv(100), pattern(10, 51), "data seen by poll")
    eq(poll1(s, IN, 0), 0, "poll POLLIN after reading")

    t0 = now()
    cmd(s, "send 10 52 200")
    r, w, x = select.select([s], [], [s], 3)
    eq((r, w, x), ([s], [], []), "select after the peer wrote")
    within(now() - t0, 0.15, 3, "select waited for the data")
    eq(s.recv(100), pattern(10, 52), "data seen by select")

    t0 = now()
    cmd(s, "send 10 53 200")
    eq(ep.poll(3), [(fd, EIN)], "epoll after the peer wrote")
    within(now() - t0, 0.15, 3, "epoll waited for the data")
    eq(ep.poll(0), [(fd, EIN)], "level-triggered epoll reports unread data again")
    eq(s.recv(100), pattern(10, 53), "data seen by epoll")
    eq(ep.poll(0), [], "epoll after reading")
    ep.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- writable: not writable when full, writable again when the peer reads ------------------------

def writable_client(args):
    s = dial(args)
    fd = s.fileno()
    # The server must be asleep before we fill, or its next read frees space at once.
    cmd(s, "ping")
    eq(recv_exact(s, 5), b"pong\n", "pong")
    cmd(s, "sleep 800")
    cmd(s, "sink")
    time.sleep(0.1)
    total = fill(s, 55)
    check(total > 0, "nothing sent before EAGAIN")
    eq(poll1(s, OUT, 0), 0, "poll POLLOUT on a full connection")
    eq(select.select([], [s], [], 0)[1], [], "select writable on a full connection")
    ep = select.epoll()
    ep.register(fd, EOUT)
    eq(ep.poll(0), [], "epoll EPOLLOUT on a full connection")
    t0 = now()
    eq(ep.poll(5), [(fd, EOUT)], "epoll EPOLLOUT once the peer reads")
    within(now() - t0, 0.1, 5, "epoll waited for space")
    eq(poll1(s, OUT, 0), OUT, "poll POLLOUT once the peer reads")
    ep.close()
    s.shutdown(socket.SHUT_WR)
    reply = recv_all(s).decode().split()
    eq(reply[:2], ["got", str(total)], "bytes the server sank")
    s.close()


# ---- hup_rdhup: half-close and full close as poll/epoll report them ---------------------------

def hup_server(conn, args):
    eq(recv_exact(conn, 3), b"go\n", "go")
    conn.shutdown(socket.SHUT_WR)
    data = recv_all(conn)
    eq(data, pattern(100, 56), "data after our SHUT_WR")
    ev = poll1(conn, IN | OUT | RDHUP, 3000)
    check(ev & IN and ev & RDHUP and ev & HUP,
          f"both directions shut: want POLLIN|POLLRDHUP|POLLHUP, got {ev:#x}")
    time.sleep(0.3)
    conn.close()


def hup_client(args):
    s = dial(args)
    fd = s.fileno()
    ep = select.epoll()
    ep.register(fd, EIN | EOUT | ERDHUP)
    s.sendall(b"go\n")
    t0 = now()
    while True:
        ev = poll1(s, IN | OUT | RDHUP, 3000)
        if ev & RDHUP:
            break
        check(now() - t0 < 3, f"POLLRDHUP never came (last {ev:#x})")
        time.sleep(0.01)
    eq(ev, IN | OUT | RDHUP, "poll after the peer's SHUT_WR")
    (efd, eev), = ep.poll(1)
    eq(eev, EIN | EOUT | ERDHUP, "epoll after the peer's SHUT_WR")
    eq(select.select([s], [s], [], 0)[:2], ([s], [s]), "select after the peer's SHUT_WR")
    eq(s.recv(10), b"", "EOF after the peer's SHUT_WR")
    s.sendall(pattern(100, 56))  # our direction still works
    s.shutdown(socket.SHUT_WR)
    time.sleep(0.05)
    ev = poll1(s, IN | RDHUP, 0)
    eq(ev, IN | RDHUP | HUP, "poll once both directions are shut")
    ep.close()
    s.close()


# ---- shut_wr_pollout: after our own SHUT_WR the kernel reports POLLOUT (the write then fails
# with EPIPE); a program waiting for writability must not block forever --------------------------

def shut_wr_pollout_client(args):
    s = dial(args)
    s.shutdown(socket.SHUT_WR)
    ev = poll1(s, IN | OUT, 0)
    eq(ev, OUT, "poll POLLIN|POLLOUT after our own SHUT_WR")
    eq(select.select([], [s], [], 0)[1], [s], "select writable after our own SHUT_WR")
    ep = select.epoll()
    ep.register(s.fileno(), EOUT)
    eq(ep.poll(0.5), [(s.fileno(), EOUT)], "epoll EPOLLOUT after our own SHUT_WR")
    ep.close()
    try:
        s.send(b"x", socket.MSG_NOSIGNAL)
        raise Fail("send after SHUT_WR succeeded")
    except BrokenPipeError:
        pass
    eq(s.recv(10), b"", "EOF (the server closes when it sees ours)")
    s.close()


def eof_pause_close(conn, args):
    # The client polls right after its SHUT_WR: our FIN must not race that poll (on a ring it
    # arrives within a microsecond, which would add POLLIN|POLLRDHUP to what the client sees).
    eq(recv_all(conn), b"", "nothing but EOF")
    time.sleep(0.5)
    conn.close()


def eof_then_close(conn, args):
    eq(recv_all(conn), b"", "nothing but EOF")
    conn.close()


def close_hup_server(conn, args):
    eq(recv_exact(conn, 3), b"go\n", "go")
    conn.close()


def close_hup_client(args):
    """Green part: POLLIN|POLLRDHUP (and EPOLLIN|EPOLLRDHUP) after the peer's close, then EOF;
    whether POLLHUP also shows is left to close_hup_strict."""
    s = dial(args)
    s.sendall(b"go\n")
    t0 = now()
    while not poll1(s, RDHUP, 3000):
        check(now() - t0 < 3, "POLLRDHUP never came")
    ev = poll1(s, IN | OUT | RDHUP, 0)
    eq(ev & ~HUP, IN | OUT | RDHUP, "poll after the peer closed (POLLHUP aside)")
    ep = select.epoll()
    ep.register(s.fileno(), EIN | EOUT | ERDHUP)
    evs = ep.poll(1)
    eq([(f, e & ~EHUP) for f, e in evs], [(s.fileno(), EIN | EOUT | ERDHUP)],
       "epoll after the peer closed (EPOLLHUP aside)")
    eq(s.recv(10), b"", "EOF")
    ep.close()
    s.close()


def close_hup_strict_client(args):
    """The kernel reports POLLHUP only once both directions are shut (or on a reset): a peer's
    close is a FIN, i.e. POLLRDHUP, not POLLHUP, as long as we have not written to it."""
    s = dial(args)
    s.sendall(b"go\n")
    t0 = now()
    while not poll1(s, RDHUP, 3000):
        check(now() - t0 < 3, "POLLRDHUP never came")
    # A blocking wait for something else entirely: nothing to report, it times out.
    t0 = now()
    eq(poll1(s, select.POLLPRI, 300), 0, "poll POLLPRI after the peer closed")
    within(now() - t0, 0.25, 1.5, "poll POLLPRI timed out")
    eq(poll1(s, IN | OUT | RDHUP, 0), IN | OUT | RDHUP, "poll after the peer closed")
    ep = select.epoll()
    ep.register(s.fileno(), EIN | EOUT | ERDHUP)
    eq(ep.poll(1), [(s.fileno(), EIN | EOUT | ERDHUP)], "epoll after the peer closed")
    eq(s.recv(10), b"", "EOF")
    ep.close()
    s.close()


# ---- epoll_et: edge-triggered reports once per new data -----------------------------------------
# The data arrive on a connection the client never writes to; commands go over a second one.

def et_server(lsock, args):
    data, _ = lsock.accept()
    control, _ = lsock.accept()
    lsock.close()
    command_server(control, out=data)


def et_client(args):
    s = dial(args)
    ctl = dial(args)
    fd = s.fileno()
    ep = select.epoll()
    ep.register(fd, EIN | EET)
    eq(ep.poll(0.1), [], "ET: nothing on an idle connection")
    cmd(ctl, "send 10 61")
    eq(ep.poll(3), [(fd, EIN)], "ET: first data")
    eq(ep.poll(0.2), [], "ET: no new data, no report")
    cmd(ctl, "send 10 62")
    eq(ep.poll(3), [(fd, EIN)], "ET: more data, a new edge")
    eq(ep.poll(0.2), [], "ET: reported once")
    eq(recv_exact(s, 10), pattern(10, 61), "first data")
    eq(ep.poll(0.1), [], "ET: a partial read is no edge")
    eq(recv_exact(s, 10), pattern(10, 62), "second data")
    cmd(ctl, "send 5 63")
    eq(ep.poll(3), [(fd, EIN)], "ET: data after draining")
    eq(s.recv(10), pattern(5, 63), "third data")
    # Re-arming with EPOLL_CTL_MOD reports the current state once.
    cmd(ctl, "send 5 64")
    eq(ep.poll(3), [(fd, EIN)], "ET: fourth data")
    ep.modify(fd, EIN | EET)
    eq(ep.poll(1), [(fd, EIN)], "ET: EPOLL_CTL_MOD re-reports pending data")
    eq(ep.poll(0.1), [], "ET: once")
    eq(s.recv(10), pattern(5, 64), "fourth data")
    ep.close()
    cmd(ctl, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()
    ctl.close()


# ---- epoll_et_quiet: the peer reading what we sent is no EPOLLIN edge ----------------------------

def et_quiet_client(args):
    s = dial(args)
    fd = s.fileno()
    ep = select.epoll()
    ep.register(fd, EIN | EET)
    cmd(s, "send 10 65")
    eq(ep.poll(3), [(fd, EIN)], "ET: first data")
    # The server reads this command and does nothing visible to us for a second.
    cmd(s, "sleep 1000")
    eq(ep.poll(0.5), [], "ET: no new data (the peer only read ours), no report")
    eq(recv_exact(s, 10), pattern(10, 65), "data")
    ep.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- epoll_oneshot: reported once until re-armed ---------------------------------------------

def oneshot_client(args):
    s = dial(args)
    fd = s.fileno()
    ep = select.epoll()
    ep.register(fd, EIN | EONE)
    cmd(s, "send 10 65")
    eq(ep.poll(3), [(fd, EIN)], "ONESHOT: first report")
    eq(ep.poll(0.2), [], "ONESHOT: disabled after the report")
    cmd(s, "send 10 66")
    eq(ep.poll(0.3), [], "ONESHOT: new data while disabled")
    ep.modify(fd, EIN | EONE)
    eq(ep.poll(1), [(fd, EIN)], "ONESHOT: re-armed with pending data")
    eq(ep.poll(0.1), [], "ONESHOT: disabled again")
    eq(recv_exact(s, 20), pattern(10, 65) + pattern(10, 66), "data")
    ep.modify(fd, EIN | EONE)
    eq(ep.poll(0.1), [], "ONESHOT: re-armed, nothing pending")
    cmd(s, "send 3 67")
    eq(ep.poll(3), [(fd, EIN)], "ONESHOT: report after re-arming")
    eq(s.recv(10), pattern(3, 67), "data")
    ep.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- epoll_two_sets: one fd in two epoll sets (LT and ET), concurrent waiters --------------------

def two_sets_client(args):
    s = dial(args)
    fd = s.fileno()
    lt, et = select.epoll(), select.epoll()
    lt.register(fd, EIN)
    et.register(fd, EIN | EET)
    cmd(s, "send 10 71")
    eq(lt.poll(3), [(fd, EIN)], "LT set")
    eq(et.poll(3), [(fd, EIN)], "ET set")
    eq(lt.poll(0), [(fd, EIN)], "LT set again")
    eq(et.poll(0.1), [], "ET set once")
    eq(recv_exact(s, 10), pattern(10, 71), "data")
    # Two threads wait, one per set; new data wakes both.
    for rnd in range(2):
        j1 = with_thread(lambda: (lt.poll(5), now()))
        j2 = with_thread(lambda: (et.poll(5), now()))
        time.sleep(0.05)
        t0 = now()
        cmd(s, f"send 10 {72 + rnd} 200")
        (r1, t1), (r2, t2) = j1(10), j2(10)
        eq(r1, [(fd, EIN)], f"LT waiter, round {rnd}")
        eq(r2, [(fd, EIN)], f"ET waiter, round {rnd}")
        within(t1 - t0, 0.15, 2, f"LT waiter woke, round {rnd}")
        within(t2 - t0, 0.15, 2, f"ET waiter woke, round {rnd}")
        eq(recv_exact(s, 10), pattern(10, 72 + rnd), "data")
    # Leaving one set does not affect the other.
    lt.unregister(fd)
    cmd(s, "send 4 79")
    eq(et.poll(3), [(fd, EIN)], "ET set after the LT set let go")
    eq(lt.poll(0.1), [], "the LT set after unregister")
    eq(s.recv(10), pattern(4, 79), "data")
    lt.close()
    et.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- mixed_wait: a connection, a pipe and a kernel socket in one poll/select/epoll ---------------

def mixed_client(kind):
    return lambda args: mixed_one(args, kind)


def mixed_one(args, kind):
    s = dial(args)
    fd = s.fileno()
    pr, pw = os.pipe()
    ua, ub = socket.socketpair()
    if True:
        if kind == "poll":
            p = select.poll()
            for f in (fd, pr, ua.fileno()):
                p.register(f, IN)

            def wait(timeout):
                return sorted(f for f, e in p.poll(None if timeout is None else timeout * 1000))
        elif kind == "select":
            def wait(timeout):
                r, _, _ = select.select([fd, pr, ua.fileno()], [], [], timeout)
                return sorted(r)
        else:
            ep = select.epoll()
            for f in (fd, pr, ua.fileno()):
                ep.register(f, EIN)

            def wait(timeout):
                return sorted(f for f, e in ep.poll(-1 if timeout is None else timeout))

        eq(wait(0), [], f"{kind}: nothing ready")
        os.write(pw, b"p")
        eq(wait(3), [pr], f"{kind}: the pipe alone")
        os.read(pr, 10)
        ub.send(b"u")
        eq(wait(3), [ua.fileno()], f"{kind}: the kernel socket alone")
        ua.recv(10)
        t0 = now()
        cmd(s, "send 3 81 200")
        eq(wait(3), [fd], f"{kind}: the connection alone")
        within(now() - t0, 0.15, 3, f"{kind}: waited for the connection")
        eq(recv_exact(s, 3), pattern(3, 81), "data")
        # A kernel fd wakes a blocked wait that also watches the connection.
        t0 = now()
        delayed(0.2, os.write, pw, b"q")
        eq(wait(3), [pr], f"{kind}: the pipe wakes a blocked wait")
        within(now() - t0, 0.15, 3, f"{kind}: waited for the pipe")
        os.read(pr, 10)
        t0 = now()
        delayed(0.2, ub.send, b"v")
        eq(wait(None), [ua.fileno()], f"{kind}: the kernel socket wakes an untimed wait")
        within(now() - t0, 0.15, 3, f"{kind}: waited for the kernel socket")
        ua.recv(10)
        # All three at once.
        cmd(s, "send 3 82")
        recv_ready = lambda: poll1(s, IN, 3000)  # noqa: E731
        check(recv_ready(), "data never arrived")
        os.write(pw, b"r")
        ub.send(b"w")
        if kind == "epoll":
            # Level-triggered epoll may spread ready fds over a few calls (the kernel does so
            # too when maxevents is short; memloop polls the kernel's fds on one call in a few
            # while rings are busy): each call has no duplicates, and together they have all.
            seen = []
            for _ in range(8):
                got = [f for f, e in ep.poll(0.5)]
                eq(len(got), len(set(got)), f"{kind}: no fd twice in one call")
                seen = sorted(set(seen) | set(got))
                if seen == sorted([fd, pr, ua.fileno()]):
                    break
            eq(seen, sorted([fd, pr, ua.fileno()]), f"{kind}: all three within a few calls")
        else:
            eq(wait(3), sorted([fd, pr, ua.fileno()]), f"{kind}: all three")
        os.read(pr, 10)
        ua.recv(10)
        eq(recv_exact(s, 3), pattern(3, 82), "data")
        if kind == "epoll":
            ep.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


# ---- timeouts: each wait returns nothing after about its timeout --------------------------------

def timeouts_client(args):
    s = dial(args)
    fd = s.fileno()
    pr, pw = os.pipe()
    ep = select.epoll()
    ep.register(fd, EIN)
    ep2 = select.epoll()
    ep2.register(fd, EIN)
    ep2.register(pr, EIN)
    checks = [
        ("poll", lambda: poll1(s, IN, 200)),
        ("poll mixed", lambda: poll_mixed(fd, pr, 200)),
        ("select", lambda: select.select([s], [], [], 0.2)[0]),
        ("select mixed", lambda: select.select([s, pr], [], [], 0.2)[0]),
        ("epoll", lambda: ep.poll(0.2)),
        ("epoll mixed", lambda: ep2.poll(0.2)),
    ]
    for name, fn in checks:
        t0 = now()
        r = fn()
        check(not r, f"{name}: reported {r!r} on an idle connection")
        within(now() - t0, 0.18, 1.5, f"{name} with a 200 ms timeout")
    for name, fn in [("poll 0", lambda: poll1(s, IN, 0)), ("epoll 0", lambda: ep.poll(0)),
                     ("select 0", lambda: select.select([s], [], [], 0)[0])]:
        t0 = now()
        check(not fn(), f"{name}: reported something")
        within(now() - t0, 0, 0.1, f"{name} returned at once")
    ep.close()
    ep2.close()
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


def poll_mixed(fd, pr, ms):
    p = select.poll()
    p.register(fd, IN)
    p.register(pr, IN)
    return p.poll(ms)


CASES = {
    "poll_select_epoll": (serve_one(commands), basic_client),
    "writable": (serve_one(commands), writable_client),
    "hup_rdhup": (serve_one(hup_server), hup_client),
    "close_hup": (serve_one(close_hup_server), close_hup_client),
    "close_hup_strict": (serve_one(close_hup_server), close_hup_strict_client),
    "epoll_et": (et_server, et_client),
    "epoll_et_quiet": (serve_one(commands), et_quiet_client),
    "epoll_oneshot": (serve_one(commands), oneshot_client),
    "epoll_two_sets": (serve_one(commands), two_sets_client),
    "shut_wr_pollout": (serve_one(eof_pause_close), shut_wr_pollout_client),
    "mixed_poll": (serve_one(commands), mixed_client("poll")),
    "mixed_select": (serve_one(commands), mixed_client("select")),
    "mixed_epoll": (serve_one(commands), mixed_client("epoll")),
    "timeouts": (serve_one(commands), timeouts_client),
}

if __name__ == "__main__":
    run(CASES)
