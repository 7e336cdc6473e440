#!/usr/bin/env python3
"""The late ring: connections that fell back to TCP at connect for a transient reason come to
their ring mid-stream (`crates/memloop-preload/src/late.rs`).

slow_accept: the server accepts 1 s after the client connected (past its decide wait); then a checksummed
stream each way at once (framed, every byte checked in order, a sha256 at the end, then EOF).
plain_client: as slow_accept with a client run without the library (it re-execs itself without
LD_PRELOAD): its connection must stay on TCP, no late offer made or taken.
region_full: the client fills the region with ring connections until one falls back, opens
the connection under test (it falls back: no ring memory), then closes the fillers: room again.

Each side streams until its own connection is seen on the ring (the kernel socket stops carrying
what it sends: TCP_INFO bytes_sent) and a while after, or until a deadline; on kernel TCP (the
reference) a fixed amount. The harness checks the libraries' logs and `memloop status`.
"""

import hashlib
import os
import random
import socket
import struct
import sys
import threading
import time

from semlib import Fail, check, dial, eq, log, run, wait_until

MB = 1 << 20
PRELOADED = "LD_PRELOAD" in os.environ
# Stream until the connection is seen on its ring (off for a peer that cannot get there).
UNTIL_RING = [True]
BLOCK = 1_000_003  # the pattern repeats after this many bytes (not a power of two)
STREAM_DEADLINE = 20.0


def block(seed):
    return random.Random(seed).randbytes(BLOCK)


def pattern_at(blk, off, n):
    off %= BLOCK
    out = blk[off : off + n]
    while len(out) < n:
        out += blk[: n - len(out)]
    return out


def kernel_bytes_sent(sock):
    """What the kernel socket took to send (doorbells only, once on a ring): TCP_INFO's
    bytes_sent plus notsent_bytes."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("Q", info, 200)[0] + struct.unpack_from("I", info, 144)[0]


def send_stream(sock, seed, errors):
    """Frames of random sizes (4-byte length + pattern), paced; a zero frame with the sha256
    of everything sent ends it, then SHUT_WR."""
    blk, rnd, h = block(seed), random.Random(seed + 1), hashlib.sha256()
    sent, after_ring, ring_at, start = 0, None, None, time.monotonic()
    window = (kernel_bytes_sent(sock), 0)
    try:
        while True:
            if (not PRELOADED or not UNTIL_RING[0]) and sent >= 4 * MB:
                break
            if after_ring is not None and sent >= after_ring:
                break
            if time.monotonic() - start > STREAM_DEADLINE:
                log(f"stream deadline: {sent} bytes sent, ring seen at {ring_at}")
                break
            n = rnd.randint(1, 65536)
            data = pattern_at(blk, sent, n)
            sock.sendall(struct.pack(">I", n) + data)
            h.update(data)
            sent += n
            if PRELOADED and UNTIL_RING[0] and after_ring is None and sent - window[1] >= MB:
                kernel = kernel_bytes_sent(sock)
                if kernel - window[0] < 4096:  # a megabyte went, not through the kernel
                    ring_at, after_ring = sent, sent + 2 * MB
                window = (kernel, sent)
            time.sleep(0.002)
        sock.sendall(struct.pack(">I", 0) + h.digest())
        sock.shutdown(socket.SHUT_WR)
        log(f"sent {sent} bytes, ring seen at {ring_at}")
    except Exception as e:  # reported by the caller
        errors.append(f"send: {type(e).__name__}: {e}")


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            raise Fail(f"EOF after {len(buf)} of {n} bytes of a frame")
        buf += b
    return bytes(buf)


def recv_stream(sock, seed, errors):
    """Checks every frame against the peer's pattern, the final sha256, then EOF."""
    blk, h, got = block(seed), hashlib.sha256(), 0
    try:
        while True:
            (n,) = struct.unpack(">I", recv_exact(sock, 4))
            if n == 0:
                eq(recv_exact(sock, 32), h.digest(), "sha256 of the stream")
                eq(sock.recv(1), b"", "EOF right after the stream")
                log(f"received {got} bytes, checked")
                return
            data = recv_exact(sock, n)
            if data != pattern_at(blk, got, n):
                raise Fail(f"wrong bytes at offset {got} (frame of {n})")
            h.update(data)
            got += n
    except Exception as e:
        errors.append(f"recv: {type(e).__name__}: {e}")


def run_threads(ts, deadline, what):
    """Starts every thread, then waits for each at most `deadline` s."""
    for t in ts:
        t.start()
    for t in ts:
        t.join(deadline)
        check(not t.is_alive(), what)


def both_ways(sock, mine, theirs):
    errors = []
    ts = [threading.Thread(target=send_stream, args=(sock, mine, errors)),
          threading.Thread(target=recv_stream, args=(sock, theirs, errors))]
    run_threads(ts, STREAM_DEADLINE + 15, "a stream thread finished")
    check(not errors, f"stream errors: {errors}")
    sock.close()


# ---- slow_accept ------------------------------------------------------------------------------

def accept_late(args):
    """Waits until the client says it connected, then past its decide wait (500 ms)."""
    wait_until(lambda: os.path.exists(args.port_file + ".connected"), 30, "the client's connect")
    time.sleep(1.0)


def connected(args):
    with open(args.port_file + ".connected", "w"):
        pass


def slow_accept_server(lsock, args):
    accept_late(args)
    conn, _ = lsock.accept()
    lsock.close()
    both_ways(conn, 2, 1)


def slow_accept_client(args):
    s = dial(args)
    connected(args)
    both_ways(s, 1, 2)


# ---- many: 16 connections accepted late, all at once -------------------------------------------

MANY = 16


def all_both_ways(socks, seeds):
    """`both_ways` on every connection at once; any failure fails the role."""
    failures = []

    def one(sock, mine, theirs):
        try:
            both_ways(sock, mine, theirs)
        except Exception as e:
            failures.append(f"{mine}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=one, args=(s, *seeds(i))) for i, s in enumerate(socks)]
    run_threads(ts, STREAM_DEADLINE + 30, "a connection finished")
    check(not failures, f"failures: {failures}")


def many_server(lsock, args):
    accept_late(args)
    conns = [lsock.accept()[0] for _ in range(MANY)]
    lsock.close()
    all_both_ways(conns, lambda i: (100 + i, i))


def many_client(args):
    # The server accepts in connect order: connection i carries seeds i and 100 + i.
    socks = [dial(args) for _ in range(MANY)]
    connected(args)
    all_both_ways(socks, lambda i: (i, 100 + i))


# ---- plain_client ------------------------------------------------------------------------------

def plain_client_server(lsock, args):
    UNTIL_RING[0] = False
    slow_accept_server(lsock, args)


def plain_client_client(args):
    if "LD_PRELOAD" in os.environ:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    slow_accept_client(args)


# ---- region_full ------------------------------------------------------------------------------

def region_full_server(lsock, args):
    def filler(conn):
        conn.sendall(b"f")
        while conn.recv(65536):
            pass
        conn.close()

    while True:
        conn, _ = lsock.accept()
        kind = recv_exact(conn, 1)
        if kind == b"F":
            threading.Thread(target=filler, args=(conn,), daemon=True).start()
            continue
        eq(kind, b"M", "connection kind")
        conn.sendall(b"m")
        lsock.close()
        both_ways(conn, 2, 1)
        return


def on_kernel(sock):
    """The connection carries its bytes through the kernel socket (not a ring)."""
    before = kernel_bytes_sent(sock)
    sock.sendall(b"\0" * 65536)
    return kernel_bytes_sent(sock) - before >= 65536


def region_full_client(args):
    fillers = []
    while len(fillers) < 64:
        s = dial(args)
        s.sendall(b"F")
        eq(recv_exact(s, 1), b"f", "filler greeting")
        fillers.append(s)
        if on_kernel(s):
            break  # the region had no room for it: full
    log(f"{len(fillers)} fillers")
    s = dial(args)
    s.sendall(b"M")
    eq(recv_exact(s, 1), b"m", "greeting")
    for f in fillers:  # room again
        f.close()
    both_ways(s, 1, 2)


if __name__ == "__main__":
    run({
        "slow_accept": (slow_accept_server, slow_accept_client),
        "region_full": (region_full_server, region_full_client),
        "plain_client": (plain_client_server, plain_client_client),
        "many": (many_server, many_client),
    })
