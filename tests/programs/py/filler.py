#!/usr/bin/env python3
"""Fills the region with idle ring connections to a server, so that the next connections fall
back to TCP for want of ring memory (`region_full`), then gives the memory back on cue.

usage: filler.py HOST PORT DIR [MEMLOOP REGION] — opens connections to HOST:PORT (each sends
an inline `PING`, which redis answers) until one goes through the kernel socket for want of
ring memory, writes DIR/filled with the count, waits for DIR/release, closes them all and
exits. With the `memloop` binary and the region's name, a connection on TCP for another reason
(a transient fallback such as `no_offer` on a loaded machine) does not count as "full": the
region's `region_full` counter must have moved. Without them (or with the server outside the
region) the first connection on TCP ends the filling.
       filler.py --serve HOST PORT — a server that answers each `PING` line with `+PONG`, for
cases whose own server speaks another protocol.
"""

import json
import os
import socket
import subprocess
import struct
import sys
import threading
import time

MAX = 600


def kernel_bytes_sent(sock):
    """TCP_INFO bytes_sent plus notsent_bytes: what went through the kernel socket."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("Q", info, 200)[0] + struct.unpack_from("I", info, 144)[0]


def region_full_count(cli):
    """The region's `region_full` fallbacks, or None when not asked to look."""
    if cli is None:
        return None
    out = subprocess.run(
        [cli[0], "status", "--json", "--region", cli[1]],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)["fallbacks"].get("region_full", 0)


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
    cli = sys.argv[4:6] if len(sys.argv) >= 6 else None
    full_before = region_full_count(cli)
    socks, transient = [], 0
    while len(socks) < MAX:
        s = socket.create_connection((host, port), timeout=30)
        socks.append(s)
        before = kernel_bytes_sent(s)
        s.sendall(b"PING\r\n")
        if s.recv(64) != b"+PONG\r\n":
            sys.exit(f"connection {len(socks)}: no PONG")
        if kernel_bytes_sent(s) - before < 6:
            continue  # on its ring
        if cli is None or region_full_count(cli) > full_before:
            break  # on TCP for want of ring memory (or the server is not in the region)
        # On TCP for another reason: close it (it could come to its ring late and be counted
        # as one of the case's late rings) and keep filling.
        socks.pop().close()
        transient += 1
        if transient > 50:
            sys.exit("50 connections went to TCP, none for want of ring memory")
    print(
        f"{len(socks)} connections, the last on TCP ({transient} transient fallbacks)",
        flush=True,
    )
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
