#!/usr/bin/env python3
"""Concurrent send and recv on one socket from two threads, both directions at once, with
checksums."""

import socket

from semlib import dial, eq, pattern, recv_all, run, serve_one, sha, with_thread

SIZE = 8 << 20


def sender(s, seed, step):
    data = pattern(SIZE, seed)
    for i in range(0, SIZE, step):
        s.sendall(data[i : i + step])
    s.shutdown(socket.SHUT_WR)


def duplex(s, out_seed, in_seed, step):
    join = with_thread(sender, s, out_seed, step)
    got = recv_all(s)
    join()
    eq(len(got), SIZE, "bytes received")
    eq(sha(got), sha(pattern(SIZE, in_seed)), "sha256 of the received stream")


def duplex_server(conn, args):
    duplex(conn, 201, 202, 100_003)
    conn.close()


def duplex_client(args):
    s = dial(args)
    duplex(s, 202, 201, 65_536)
    s.close()


CASES = {"duplex_threads": (serve_one(duplex_server), duplex_client)}

if __name__ == "__main__":
    run(CASES)
