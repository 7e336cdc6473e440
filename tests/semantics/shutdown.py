#!/usr/bin/env python3
"""Half-close and close: SHUT_WR gives the peer EOF after all data and the peer can still answer;
close() with data still queued delivers everything, then EOF."""

import select
import socket
import time

from semlib import Fail, check, dial, eq, pattern, poll1, recv_all, run, serve_one, sha

UP = 100_000
DOWN = 50_000
BULK = 2 << 20


def shut_wr_server(conn, args):
    data = recv_all(conn)
    eq(len(data), UP, "bytes before EOF")
    eq(sha(data), sha(pattern(UP, 41)), "data before EOF")
    ev = poll1(conn, select.POLLIN | select.POLLRDHUP, 0)
    check(ev & select.POLLIN and ev & select.POLLRDHUP, f"poll after EOF: {ev:#x}")
    check(not ev & select.POLLHUP, f"POLLHUP while our direction is open: {ev:#x}")
    eq(conn.recv(10), b"", "EOF is sticky")
    conn.sendall(f"done {sha(data)}\n".encode())
    conn.sendall(pattern(DOWN, 42))
    conn.close()


def shut_wr_client(args):
    s = dial(args)
    s.sendall(pattern(UP, 41))
    s.shutdown(socket.SHUT_WR)
    try:
        s.send(b"late", socket.MSG_NOSIGNAL)
        raise Fail("send after SHUT_WR succeeded")
    except BrokenPipeError:
        pass
    reply = recv_all(s)
    line, _, rest = reply.partition(b"\n")
    eq(line.decode(), f"done {sha(pattern(UP, 41))}", "the server's summary")
    eq(len(rest), DOWN, "bytes the server sent after our SHUT_WR")
    eq(rest, pattern(DOWN, 42), "data the server sent after our SHUT_WR")
    s.close()


def close_server(conn, args):
    conn.sendall(pattern(BULK, 43))
    for i in range(10):
        conn.send(bytes([i]))
    conn.close()  # probably with data still queued


def close_client(args):
    s = dial(args)
    time.sleep(0.3)  # let the server block on a full buffer first
    data = recv_all(s)
    eq(len(data), BULK + 10, "bytes delivered before EOF")
    check(data[:BULK] == pattern(BULK, 43), "bulk data intact")
    eq(data[BULK:], bytes(range(10)), "the small writes before close")
    eq(s.recv(10), b"", "EOF is sticky")
    s.close()


CASES = {
    "shut_wr": (serve_one(shut_wr_server), shut_wr_client),
    "close_delivers": (serve_one(close_server), close_client),
}

if __name__ == "__main__":
    run(CASES)
