#!/usr/bin/env python3
"""Byte-stream semantics: bulk echo, small messages, MSG_PEEK, MSG_WAITALL, MSG_DONTWAIT,
writes to a closed peer (EPIPE with MSG_NOSIGNAL, SIGPIPE without)."""

import hashlib
import signal
import socket
import struct
import time

import select

from semlib import (Fail, check, cmd, dial, eq, expect_eof, now, pattern, poll1, recv_exact, run,
                    serve_commands, serve_one, sha, wait_until, within, with_thread)

MB = 1 << 20


# ---- echo_10mb: 10 MB echoed, sha256 checked both ways ----------------------------------------

def echo_server(conn, args):
    h = hashlib.sha256()
    while True:
        b = conn.recv(256 * 1024)
        if not b:
            break
        h.update(b)
        conn.sendall(b)
    conn.sendall(h.hexdigest().encode() + b"\n")
    conn.close()


def echo_client(args):
    size = int(args.extra or 10 * MB)
    data = pattern(size, 1)
    s = dial(args)

    def sender():
        for i in range(0, len(data), 65536):
            s.sendall(data[i : i + 65536])
        s.shutdown(socket.SHUT_WR)

    join = with_thread(sender)
    echo = recv_exact(s, len(data), "the echo")
    join()
    tail = b""
    while True:
        b = s.recv(4096)
        if not b:
            break
        tail += b
    s.close()
    eq(sha(echo), sha(data), "sha256 of the echo")
    eq(tail.decode().strip(), sha(data), "sha256 the server computed")


# ---- small_messages: ping-pong and a stream of tiny framed writes -----------------------------

PINGS = 2000
SMALL = 20000


def small_server(conn, args):
    for i in range(PINGS):
        (v,) = struct.unpack("<Q", recv_exact(conn, 8, "ping"))
        eq(v, i, "ping sequence")
        conn.sendall(struct.pack("<Q", v + 1))
    h = hashlib.sha256()
    count = 0
    while True:
        (n,) = struct.unpack("<H", recv_exact(conn, 2, "frame header"))
        if n == 0:
            break
        h.update(recv_exact(conn, n, "frame"))
        count += 1
    conn.sendall(f"{count} {h.hexdigest()}\n".encode())
    expect_eof(conn, "EOF after the last frame")
    conn.close()


def small_client(args):
    s = dial(args)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(PINGS):
        s.sendall(struct.pack("<Q", i))
        (v,) = struct.unpack("<Q", recv_exact(s, 8, "pong"))
        eq(v, i + 1, "pong value")
    h = hashlib.sha256()
    payload = pattern(SMALL * 64, 2)
    lens = pattern(SMALL, 3)
    off = 0
    for i in range(SMALL):
        n = 1 + lens[i] % 64
        p = payload[off : off + n]
        off += n
        h.update(p)
        s.send(struct.pack("<H", n) + p)
    s.sendall(struct.pack("<H", 0))
    reply = b""
    while not reply.endswith(b"\n"):
        b = s.recv(200)
        check(b, "EOF before the server's summary")
        reply += b
    s.shutdown(socket.SHUT_WR)
    eq(reply.decode().split(), [str(SMALL), h.hexdigest()], "frames the server saw")
    expect_eof(s)
    s.close()


# ---- peek: MSG_PEEK leaves the data; a blocking peek waits -------------------------------------

def peek_client(args):
    s = dial(args)
    try:
        s.recv(10, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        raise Fail("MSG_PEEK|MSG_DONTWAIT on an empty socket did not raise EAGAIN")
    except BlockingIOError:
        pass
    want = pattern(11, 5)
    cmd(s, "send 11 5")
    check(poll1(s, select.POLLIN, 3000) & select.POLLIN, "data never became readable")
    eq(s.recv(5, socket.MSG_PEEK), want[:5], "peek of 5 bytes")
    eq(s.recv(100, socket.MSG_PEEK), want, "second peek sees everything again")
    buf = bytearray(4)
    eq(s.recv_into(buf, 4, socket.MSG_PEEK), 4, "recv_into with MSG_PEEK")
    eq(bytes(buf), want[:4], "recv_into peeked bytes")
    eq(s.recv(100), want, "the read after peeking")
    # A blocking peek waits for data, then a read returns the same bytes.
    want = pattern(7, 6)
    t0 = now()
    cmd(s, "send 7 6 200")
    eq(s.recv(100, socket.MSG_PEEK), want, "blocking peek")
    within(now() - t0, 0.15, 3.0, "blocking peek waited for the delayed data")
    eq(s.recv(100), want, "read after the blocking peek")
    cmd(s, "close")
    expect_eof(s)
    s.close()


# ---- waitall: MSG_WAITALL gathers pieces, returns short at EOF --------------------------------

def waitall_client(args):
    s = dial(args)
    t0 = now()
    cmd(s, "pieces 3000 7 3 100")
    got = s.recv(3000, socket.MSG_WAITALL)
    eq(len(got), 3000, "MSG_WAITALL length over three pieces")
    eq(got, pattern(3000, 7), "MSG_WAITALL data")
    within(now() - t0, 0.15, 5.0, "MSG_WAITALL waited for all pieces")
    cmd(s, "send 500 8")
    cmd(s, "shutwr")
    got = s.recv(1000, socket.MSG_WAITALL)
    eq(got, pattern(500, 8), "MSG_WAITALL returns what there is at EOF")
    expect_eof(s)
    cmd(s, "close")
    s.close()


# ---- dontwait: MSG_DONTWAIT on empty and on full ------------------------------------------------

def dontwait_client(args):
    s = dial(args)
    t0 = now()
    try:
        s.recv(100, socket.MSG_DONTWAIT)
        raise Fail("MSG_DONTWAIT on an empty socket did not raise EAGAIN")
    except BlockingIOError:
        pass
    within(now() - t0, 0.0, 0.5, "MSG_DONTWAIT returned at once")
    cmd(s, "send 64 9")
    check(poll1(s, select.POLLIN, 3000) & select.POLLIN, "data never became readable")
    eq(s.recv(100, socket.MSG_DONTWAIT), pattern(64, 9), "MSG_DONTWAIT read")
    # The server sleeps, then sinks everything: meanwhile we fill until EAGAIN.
    cmd(s, "sleep 800")
    cmd(s, "sink")
    t0 = now()
    total, digest = fill_hashing(s, 10)
    within(now() - t0, 0.0, 0.7, "filling until EAGAIN")
    check(total > 0, "nothing could be sent before EAGAIN")
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        b = s.recv(200)
        if not b:
            break
        reply += b
    eq(reply.decode().split(), ["got", str(total), digest], "what the server sank")
    s.close()


def fill_hashing(sock, seed):
    chunk = pattern(65536, seed)
    h = hashlib.sha256()
    total = 0
    while total < (256 << 20):
        try:
            n = sock.send(chunk, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return total, h.hexdigest()
        h.update(chunk[:n])
        total += n
    raise Fail("send never said EAGAIN")


# ---- nosignal_epipe / sigpipe: writing to a closed peer -----------------------------------------

def close_at_once(conn, args):
    conn.close()


def write_until_epipe(s, flags):
    for _ in range(200):
        try:
            s.send(b"x" * 100, flags)
        except BrokenPipeError:
            return
        time.sleep(0.01)
    raise Fail("writes to a closed peer never failed with EPIPE")


def nosignal_client(args):
    hits = []
    signal.signal(signal.SIGPIPE, lambda *_: hits.append(1))
    s = dial(args)
    expect_eof(s, "EOF from the closed peer")
    write_until_epipe(s, socket.MSG_NOSIGNAL)
    time.sleep(0.05)
    eq(len(hits), 0, "SIGPIPE count with MSG_NOSIGNAL")
    s.close()


def sigpipe_client(args):
    hits = []
    signal.signal(signal.SIGPIPE, lambda *_: hits.append(1))
    s = dial(args)
    expect_eof(s, "EOF from the closed peer")
    write_until_epipe(s, 0)
    wait_until(lambda: hits, 1.0, "SIGPIPE after EPIPE")
    s.close()


CASES = {
    "echo_10mb": (serve_one(echo_server), echo_client),
    "small_messages": (serve_one(small_server), small_client),
    "peek": (serve_commands, peek_client),
    "waitall": (serve_commands, waitall_client),
    "dontwait": (serve_commands, dontwait_client),
    "nosignal_epipe": (serve_one(close_at_once), nosignal_client),
    "sigpipe": (serve_one(close_at_once), sigpipe_client),
}

if __name__ == "__main__":
    run(CASES)
