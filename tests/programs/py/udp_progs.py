#!/usr/bin/env python3
"""UDP programs of the real-program suite (tests/programs/cases/udp.sh):

  asyncio-server --host H --port P --clients N   an asyncio datagram echo server (its epoll
                                                 loop); exits after N clients said "end"
  client --host H --port P --clients N --count M N sockets, M echoed datagrams each (sizes
                                                 up to 8 KiB, contents and sources checked),
                                                 interleaved; prints "OK N×M" and exits 0"""

import argparse
import asyncio
import hashlib
import socket
import sys


def payload(k, i):
    n = 1 + (i * 131 + k * 977) % 8192
    seed = hashlib.sha256(b"%d/%d" % (k, i)).digest()
    return (seed * (n // 32 + 1))[:n]


def family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def server(a):
    class Echo(asyncio.DatagramProtocol):
        def __init__(self, done):
            self.done, self.ends = done, 0

        def connection_made(self, t):
            self.t = t

        def datagram_received(self, data, addr):
            if data == b"end":
                self.ends += 1
                if self.ends == a.clients:
                    self.done.set_result(True)
                return
            self.t.sendto(data, addr)

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        t, _ = await loop.create_datagram_endpoint(
            lambda: Echo(done), local_addr=(a.host, a.port), family=family(a.host))
        print("listening", flush=True)
        await done
        t.close()

    asyncio.run(main())
    print("server done", flush=True)


def client(a):
    to = (a.host, a.port)
    socks = [socket.socket(family(a.host), socket.SOCK_DGRAM) for _ in range(a.clients)]
    for s in socks:
        s.settimeout(10)
    for i in range(a.count):
        for k, s in enumerate(socks):
            s.sendto(payload(k, i), to)
        for k, s in enumerate(socks):
            d, frm = s.recvfrom(65536)
            if d != payload(k, i) or frm[1] != a.port:
                print(f"FAIL socket {k} datagram {i}: {len(d)} bytes from {frm}", flush=True)
                sys.exit(1)
    for s in socks:
        s.sendto(b"end", to)
    print(f"OK {a.clients}x{a.count}", flush=True)


ap = argparse.ArgumentParser()
ap.add_argument("role", choices=["asyncio-server", "client"])
ap.add_argument("--host", required=True)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--clients", type=int, default=8)
ap.add_argument("--count", type=int, default=500)
args = ap.parse_args()
server(args) if args.role == "asyncio-server" else client(args)
