#!/usr/bin/env python3
"""getsockname/getpeername agree across the connection; a dual-stack listener sees an IPv4
client as ::ffff:a.b.c.d."""

import socket

from semlib import dial, eq, recv_exact, run, serve_one

WIDTH = 200


def addr_text(a):
    return f"{a[0]} {a[1]}".ljust(WIDTH).encode()


def parse(b):
    h, p = b.decode().split()
    return h, int(p)


def names_server(conn, args):
    mine = conn.getsockname()[:2]
    peer = conn.getpeername()[:2]
    conn.sendall(addr_text(mine) + addr_text(peer))
    c_mine = parse(recv_exact(conn, WIDTH))
    c_peer = parse(recv_exact(conn, WIDTH))
    if args.extra == "dualstack":
        eq(conn.family, socket.AF_INET6, "family of a connection on a dual-stack listener")
        eq(peer, ("::ffff:" + c_mine[0], c_mine[1]), "the IPv4 client, as the server sees it")
        eq(mine, ("::ffff:" + c_peer[0], c_peer[1]), "the server's own name")
    else:
        eq(peer, c_mine, "server's getpeername vs client's getsockname")
        eq(mine, c_peer, "server's getsockname vs client's getpeername")
    eq(conn.recv(10), b"", "EOF")
    conn.close()


def names_client(args):
    s = dial(args)
    mine = s.getsockname()[:2]
    peer = s.getpeername()[:2]
    eq(peer, (args.host, args.port), "getpeername is where we connected")
    s.sendall(addr_text(mine) + addr_text(peer))
    s_mine = parse(recv_exact(s, WIDTH))
    s_peer = parse(recv_exact(s, WIDTH))
    if args.extra == "dualstack":
        eq(s_peer, ("::ffff:" + mine[0], mine[1]), "the server saw our mapped address")
    else:
        eq(s_peer, mine, "client's getsockname vs server's getpeername")
        eq(s_mine, peer, "client's getpeername vs server's getsockname")
    s.shutdown(socket.SHUT_WR)
    eq(s.recv(10), b"", "EOF")
    s.close()


CASES = {"names": (serve_one(names_server), names_client)}

if __name__ == "__main__":
    run(CASES)
