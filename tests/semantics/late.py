#!/usr/bin/env python3
"""The late ring: connections that fell back to TCP at connect for a transient reason come to
their ring mid-stream (`crates/memloop-preload/src/late.rs`).

slow_accept: the server accepts 1 s after the client connected (past its decide wait); then a checksummed
stream each way at once (framed, every byte checked in order, a sha256 at the end, then EOF).
plain_client: as slow_accept with a client run without the library (it re-execs itself without
LD_PRELOAD): its connection must stay on TCP, no late offer made or taken.
region_full: the client fills the region with ring connections until one falls back, opens
the connection under test (it falls back: no ring memory), then closes the fillers: room again.
evloop_epoll: as slow_accept with both ends single-threaded event loops on non-blocking
sockets: the client connects without blocking and watches its socket with epoll (edge-triggered,
registered while the connect is still deciding), the server with poll.
joined_later: the server listens before its region exists (`--extra`: the memloop binary, to
create it); the client connects once it does, and falls back (nobody listens in the region).
evloop_select: the same with the server's loop on epoll (level-triggered, registered after
the accept) and the client's on select.
forked_server: as slow_accept with a server that forks per connection (postgres): the child
streams, the parent closes its copy at once.
forked_shared: the parent keeps its copy open while the child streams a fixed 48 MB: the
connection is held by two processes for as long as it runs, so it must stay on TCP.
forked_exit: the forked child greets and calls C `exit` without closing (the kernel closes its
fds): the server's decline marker must still be freed while the parent lives (`--extra`:
the memloop binary, to look).

Each side streams until its own connection is seen on the ring (the kernel socket stops carrying
what it sends: TCP_INFO bytes_sent) and a while after, or until a deadline; on kernel TCP (the
reference) a fixed amount. The harness checks the libraries' logs and `memloop status`.
"""

import ctypes
import errno
import json
import hashlib
import os
import random
import select
import socket
import struct
import subprocess
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
# Bytes each way when not streaming until the ring (the reference, a peer that cannot get there).
FIXED_BYTES = [4 * MB]


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
            if (not PRELOADED or not UNTIL_RING[0]) and sent >= FIXED_BYTES[0]:
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


# ---- forked_server, forked_shared: a server that forks per connection --------------------------

def forked(lsock, args, parent_keeps):
    """Accepts late, forks: the child streams and exits; the parent closes its copy at once or
    only after the child is done."""
    accept_late(args)
    conn, _ = lsock.accept()
    lsock.close()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            both_ways(conn, 2, 1)
        except BaseException as e:  # reported through the exit status
            log(f"forked handler: {type(e).__name__}: {e}")
            code = 1
        os._exit(code)
    if not parent_keeps:
        conn.close()
    _, status = os.waitpid(pid, 0)
    conn.close()
    eq(os.waitstatus_to_exitcode(status), 0, "the forked handler's exit status")


def forked_server_server(lsock, args):
    forked(lsock, args, parent_keeps=False)


def forked_shared_server(lsock, args):
    UNTIL_RING[0] = False
    FIXED_BYTES[0] = 48 * MB
    forked(lsock, args, parent_keeps=True)


def forked_shared_client(args):
    UNTIL_RING[0] = False
    FIXED_BYTES[0] = 48 * MB
    slow_accept_client(args)


def region_channels(memloop):
    out = subprocess.run([memloop, "status", "--json"], check=True, capture_output=True).stdout
    return json.loads(out)["usage"]["channels"]


def forked_exit_server(lsock, args):
    accept_late(args)
    conn, _ = lsock.accept()
    lsock.close()
    pid = os.fork()
    if pid == 0:
        conn.sendall(b"bye\n")
        ctypes.CDLL(None).exit(0)  # C exit: atexit handlers run, no socket is closed
    conn.close()
    _, status = os.waitpid(pid, 0)
    eq(os.waitstatus_to_exitcode(status), 0, "the handler's exit status")
    if PRELOADED and args.extra:
        # We published the marker and still live: only its holders can have freed it.
        wait_until(lambda: region_channels(args.extra) == 0, 10, "the decline marker freed")


def forked_exit_client(args):
    s = dial(args)
    connected(args)
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    eq(got, b"bye\n", "the handler's greeting, then EOF")
    s.close()


# ---- evloop: the same streams from single-threaded event loops ---------------------------------

class Frames:
    """`send_stream`'s frames, made one at a time by an event loop: paced (one per 2 ms), until
    the connection is seen on its ring and a while after (or a deadline)."""

    def __init__(self, sock, seed):
        self.sock, self.blk, self.rnd = sock, block(seed), random.Random(seed + 1)
        self.h, self.sent, self.after_ring, self.ring_at = hashlib.sha256(), 0, None, None
        self.start = self.last = time.monotonic()
        self.window = (kernel_bytes_sent(sock), 0)
        self.done = False

    def finished(self):
        if (not PRELOADED or not UNTIL_RING[0]) and self.sent >= FIXED_BYTES[0]:
            return True
        if self.after_ring is not None and self.sent >= self.after_ring:
            return True
        return time.monotonic() - self.start > STREAM_DEADLINE

    def next(self):
        """The next bytes to send (the last frame carries the sha256), b"" while pacing, None
        when all went."""
        if self.done:
            return None
        if time.monotonic() - self.last < 0.002:
            return b""
        self.last = time.monotonic()
        if self.finished():
            self.done = True
            log(f"sent {self.sent} bytes, ring seen at {self.ring_at}")
            return struct.pack(">I", 0) + self.h.digest()
        n = self.rnd.randint(1, 65536)
        data = pattern_at(self.blk, self.sent, n)
        self.h.update(data)
        self.sent += n
        if PRELOADED and UNTIL_RING[0] and self.after_ring is None \
                and self.sent - self.window[1] >= MB:
            kernel = kernel_bytes_sent(self.sock)
            if kernel - self.window[0] < 4096:
                self.ring_at, self.after_ring = self.sent, self.sent + 2 * MB
            self.window = (kernel, self.sent)
        return struct.pack(">I", n) + data


class Checker:
    """`recv_stream`'s checks on bytes as they come."""

    def __init__(self, seed):
        self.blk, self.h, self.got, self.buf = block(seed), hashlib.sha256(), 0, bytearray()
        self.ended = False  # the zero frame and its sha256 came (EOF must follow)

    def feed(self, b):
        if self.ended:
            raise Fail(f"{len(b)} bytes after the stream's end")
        self.buf += b
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from(">I", self.buf)
            need = 4 + (n if n else 32)
            if len(self.buf) < need:
                return
            body = bytes(self.buf[4:need])
            del self.buf[:need]
            if n == 0:
                eq(body, self.h.digest(), "sha256 of the stream")
                self.ended = True
                if self.buf:
                    raise Fail(f"{len(self.buf)} bytes after the stream's end")
                log(f"received {self.got} bytes, checked")
                return
            if body != pattern_at(self.blk, self.got, n):
                raise Fail(f"wrong bytes at offset {self.got} (frame of {n})")
            self.h.update(body)
            self.got += n

    def eof(self):
        check(self.ended, f"EOF after {self.got} bytes, before the stream's end")


def pump(sock, frames, checker, wait):
    """One event loop: `wait(want_write, timeout)` says (readable, writable). Reads until
    EAGAIN (edge-triggered waits need it) and writes whatever the socket takes, until both
    streams end."""
    pending, eof, shut = b"", False, False
    deadline = time.monotonic() + STREAM_DEADLINE + 15
    while not (eof and shut):
        check(time.monotonic() < deadline, "the event loop finished in time")
        if not pending and not shut:
            nxt = frames.next()
            if nxt is None:
                sock.shutdown(socket.SHUT_WR)
                shut = True
            else:
                pending = nxt
        readable, _ = wait(bool(pending), 0.002)
        while readable and not eof:
            try:
                b = sock.recv(262144)
            except BlockingIOError:
                break
            if not b:
                checker.eof()
                eof = True
            else:
                checker.feed(b)
        while pending:  # non-blocking: as much as the socket takes now
            try:
                n = sock.send(pending)
            except BlockingIOError:
                break
            pending = pending[n:]
    sock.close()


def poll_wait(sock):
    p = select.poll()
    p.register(sock, select.POLLIN)

    def wait(want_write, timeout):
        p.modify(sock, select.POLLIN | (select.POLLOUT if want_write else 0))
        ev = dict(p.poll(timeout * 1000)).get(sock.fileno(), 0)
        return ev & (select.POLLIN | select.POLLHUP | select.POLLERR), ev & select.POLLOUT
    return wait


def select_wait(sock):
    def wait(want_write, timeout):
        r, w, _ = select.select([sock], [sock] if want_write else [], [], timeout)
        return bool(r), bool(w)
    return wait


def epoll_wait(sock, ep, et):
    """`ep` already watches `sock` (for IN|OUT, edge-triggered if `et`)."""
    def wait(want_write, timeout):
        ev = 0
        for _, e in ep.poll(timeout):
            ev |= e
        # Edge-triggered: an edge seen once is not seen again, so try both every time.
        if et:
            return True, True
        return ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR), ev & select.EPOLLOUT
    return wait


def evloop_epoll_server(lsock, args):
    accept_late(args)
    conn, _ = lsock.accept()
    lsock.close()
    conn.setblocking(False)
    pump(conn, Frames(conn, 2), Checker(1), poll_wait(conn))


def evloop_epoll_client(args):
    fam = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setblocking(False)
    err = s.connect_ex((args.host, args.port))
    check(err in (0, errno.EINPROGRESS), f"non-blocking connect: {err}")
    ep = select.epoll()
    ep.register(s, select.EPOLLIN | select.EPOLLOUT | select.EPOLLET)
    until = time.monotonic() + 10
    while not any(e & select.EPOLLOUT for _, e in ep.poll(0.1)):
        check(time.monotonic() < until, "the connect completed")
    eq(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), 0, "SO_ERROR after connect")
    connected(args)
    pump(s, Frames(s, 1), Checker(2), epoll_wait(s, ep, True))
    ep.close()


def evloop_select_server(lsock, args):
    accept_late(args)
    conn, _ = lsock.accept()
    lsock.close()
    conn.setblocking(False)
    ep = select.epoll()
    ep.register(conn, select.EPOLLIN | select.EPOLLOUT)
    pump(conn, Frames(conn, 2), Checker(1), epoll_wait(conn, ep, False))
    ep.close()


def evloop_select_client(args):
    s = dial(args)
    connected(args)
    s.setblocking(False)
    pump(s, Frames(s, 1), Checker(2), select_wait(s))


# ---- joined_later: the server listens before its region exists -------------------------------

def joined_later_server(lsock, args):
    region = os.environ.get("MEMLOOP_REGION")
    if "LD_PRELOAD" in os.environ and region:
        # Listening already (dormant: no region); the region comes now. `--extra`: memloop.
        subprocess.run([args.extra, "region", "create", "--region", region], check=True,
                       stdout=subprocess.DEVNULL)
    with open(args.port_file + ".region", "w"):
        pass
    conn, _ = lsock.accept()
    lsock.close()
    both_ways(conn, 2, 1)


def joined_later_client(args):
    wait_until(lambda: os.path.exists(args.port_file + ".region"), 30, "the region")
    time.sleep(1.2)  # past the server's next try to join (once a second while dormant)
    s = dial(args)
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
        "evloop_epoll": (evloop_epoll_server, evloop_epoll_client),
        "evloop_select": (evloop_select_server, evloop_select_client),
        "joined_later": (joined_later_server, joined_later_client),
        "forked_server": (forked_server_server, slow_accept_client),
        "forked_shared": (forked_shared_server, forked_shared_client),
        "forked_exit": (forked_exit_server, forked_exit_client),
    })
