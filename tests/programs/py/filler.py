#!/usr/bin/env python3
"""Fills the region with idle ring connections to a server, so that the next connections fall
back to TCP for want of ring memory (`region_full`), then gives the memory back on cue.

usage: filler.py HOST PORT DIR — opens connections to HOST:PORT (each sends an inline
`PING`, which redis answers) until one goes through the kernel socket (no ring memory left,
or no ring at all: the server is outside the region), writes DIR/filled with the count, waits
for DIR/release, closes them all and exits.
       filler.py --serve HOST PORT — a server that answers each `PING` line with `+PONG`, for
cases whose own server speaks another protocol.
"""

import os
import socket
import struct
import sys
import threading
import time

MAX = 600


def kernel_bytes_sent(sock):
    """TCP_INFO bytes_sent plus notsent_bytes: what went through the kernel socket."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("Q", info, 200)[0] + struct.unpack_from("I", info, 144)[0]


def serve(host, port):
    def pong(conn):
        with conn:
            while conn.recv(64):
                conn.sendall(b"+PONG\r\n")

    lsock = socket.create_server((host, port), backlog=MAX)
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=pong, args=(conn,), daemon=True).start()


def main():
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    host, port, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    socks = []
    while len(socks) < MAX:
        s = socket.create_connection((host, port), timeout=30)
        socks.append(s)
        before = kernel_bytes_sent(s)
        s.sendall(b"PING\r\n")
        if s.recv(64) != b"+PONG\r\n":
            sys.exit(f"connection {len(socks)}: no PONG")
        if kernel_bytes_sent(s) - before >= 6:
            break  # on TCP: the region is full (or the server is not in it)
    print(f"{len(socks)} connections, the last on TCP", flush=True)
    with open(os.path.join(d, "filled"), "w") as f:
        f.write(f"{len(socks)}\n")
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(d, "release")):
        if time.monotonic() > deadline:
            sys.exit("never released")
        time.sleep(0.05)
    for s in socks:
        s.close()
    print("released", flush=True)


if __name__ == "__main__":
    main()
