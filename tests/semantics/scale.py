#!/usr/bin/env python3
"""Scale: many connections and many client processes on one server (issue 14).

ten_thousand: the client opens N connections (`--extra`, default 10000) and keeps them all
open; then each sends 64 bytes of its own pattern, then the client reads every echo back
(checked); then it closes them all. The server is one epoll loop (selectors) that echoes
until it has seen N connections end. Both raise RLIMIT_NOFILE for N sockets.

hold (for scripts/bench-scale.sh): the client opens N connections, writes PORT_FILE.held,
waits for PORT_FILE.release, then closes them (the server is the echo loop).

many_processes: the client forks N short-lived processes (`--extra`, default 1000), at most 8
at a time; each connects, sends 64 bytes of its own pattern, reads the echo (checked) and
exits without closing (the kernel closes its socket). The server is the same echo loop.
"""

import os
import resource
import selectors
import socket
import time

from semlib import Fail, dial, eq, log, pattern, recv_exact, run

MSG = 64


def count(args, default):
    return int(args.extra) if args.extra else default


def room_for(n):
    """RLIMIT_NOFILE for n sockets and some."""
    want = n + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))


def echo_server(lsock, args, n):
    """Echoes on every connection until n of them have ended."""
    room_for(n)
    lsock.listen(1024)
    lsock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    ended = 0
    while ended < n:
        for key, _ in sel.select():
            if key.fileobj is lsock:
                accept_all(lsock, sel)
                continue
            conn = key.fileobj
            try:
                data = conn.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                conn.setblocking(True)
                conn.sendall(data)
                conn.setblocking(False)
            else:
                sel.unregister(conn)
                conn.close()
                ended += 1
    log(f"{ended} connections served")


def accept_all(lsock, sel):
    while True:
        try:
            conn, _ = lsock.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)


def echo_once(sock, seed):
    data = pattern(MSG, seed)
    sock.sendall(data)
    eq(recv_exact(sock, MSG, f"echo {seed}"), data, f"echo of connection {seed}")


def exchange_all(socks):
    """Every connection sends, then every echo is read: all in flight at once, as a busy server
    sees them (one at a time, each exchange would wait for one epoll_wait, whose emulation
    looks at every ring member: docs/ARCHITECTURE.md, "Scale limit of the emulation")."""
    for i, s in enumerate(socks):
        s.sendall(pattern(MSG, i))
    for i, s in enumerate(socks):
        eq(recv_exact(s, MSG, f"echo {i}"), pattern(MSG, i), f"echo of connection {i}")


def ten_thousand_server(lsock, args):
    echo_server(lsock, args, count(args, 10000))


def ten_thousand_client(args):
    n = count(args, 10000)
    room_for(n)
    socks = []
    for i in range(n):
        socks.append(dial(args))
        if (i + 1) % 1000 == 0:
            log(f"{i + 1} connections open")
    exchange_all(socks)
    log(f"{n} echoes checked with every connection open")
    for s in socks:
        s.close()


def hold_client(args):
    n = count(args, 10000)
    room_for(n)
    socks = [dial(args) for _ in range(n)]
    exchange_all(socks)  # decided and on their rings before anyone measures
    with open(args.port_file + ".held", "w") as f:
        f.write(str(n))
    while not os.path.exists(args.port_file + ".release"):
        time.sleep(0.05)
    for s in socks:
        s.close()


def many_processes_server(lsock, args):
    echo_server(lsock, args, count(args, 1000))


def many_processes_client(args):
    n = count(args, 1000)
    running, failed = 0, 0
    for i in range(n):
        if running == 8:
            failed += reap()
            running -= 1
        pid = os.fork()
        if pid == 0:
            child(args, i)
        running += 1
    while running:
        failed += reap()
        running -= 1
    if failed:
        raise Fail(f"{failed} of {n} client processes failed")
    log(f"{n} client processes done")


def child(args, i):
    try:
        echo_once(dial(args), i)
    except BaseException as e:  # the parent counts it
        log(f"client process {i}: {type(e).__name__}: {e}")
        os._exit(1)
    os._exit(0)  # without closing: the kernel closes the socket


def reap():
    _, status = os.wait()
    return 0 if os.waitstatus_to_exitcode(status) == 0 else 1


if __name__ == "__main__":
    run({
        "ten_thousand": (ten_thousand_server, ten_thousand_client),
        "many_processes": (many_processes_server, many_processes_client),
        "hold": (ten_thousand_server, hold_client),
    })
