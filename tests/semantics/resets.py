#!/usr/bin/env python3
"""Abortive closes: the kernel answers them with a reset, and the survivor reads the data that
arrived first, then gets ECONNRESET (poll shows POLLERR|POLLHUP):
  linger0        the peer closes with SO_LINGER {1, 0};
  close_unread   the peer closes with our data still unread in its receive queue."""

import select
import socket
import struct
import time

from semlib import Fail, check, dial, eq, poll1, recv_exact, run, serve_one, wait_until
from vectored import fionread

IN, ERR, HUP, RDHUP = select.POLLIN, select.POLLERR, select.POLLHUP, select.POLLRDHUP


def linger0_server(conn, args):
    eq(recv_exact(conn, 3), b"go\n", "go")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.sendall(b"data")
    time.sleep(0.1)
    conn.close()


def unread_server(conn, args):
    eq(recv_exact(conn, 3), b"go\n", "go")
    wait_until(lambda: fionread(conn.fileno()) >= 5, 5, "the client's unread bytes")
    conn.sendall(b"data")
    time.sleep(0.1)
    conn.close()  # "unread" is still queued: a reset


def reset_client(args):
    s = dial(args)
    s.sendall(b"go\n")
    if args.case == "close_unread":
        s.sendall(b"unread")
    t0 = time.monotonic()
    while not poll1(s, IN | RDHUP, 3000) & (RDHUP | HUP | ERR):
        check(time.monotonic() - t0 < 3, "the peer's close never showed")
        time.sleep(0.01)
    time.sleep(0.1)
    eq(poll1(s, IN | RDHUP, 0), IN | ERR | HUP | RDHUP, "poll after the peer's reset")
    eq(s.recv(10), b"data", "data that came before the reset")
    try:
        b = s.recv(10)
        raise Fail(f"recv after the reset returned {b!r}, want ECONNRESET")
    except ConnectionResetError:
        pass
    s.close()


CASES = {
    "linger0": (serve_one(linger0_server), reset_client),
    "close_unread": (serve_one(unread_server), reset_client),
}

if __name__ == "__main__":
    run(CASES)
