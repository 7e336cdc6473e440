#!/usr/bin/env python3
"""Switch storms.
storm: many connections, each a checksummed bidirectional stream (random write
sizes, both directions at once), switched from ring to TCP at random moments by three
triggers: the server passing its own fd to itself with SCM_RIGHTS, the client doing the
same, and `memloop demote --all` fired by the client at random intervals (MEMLOOP_BIN).
  storm   --extra N: N connections (default 200), one after another.
flip: N long connections (--extra N, default 4), 96 MiB each way with random write sizes,
demoted and promoted back and forth by `memloop demote|promote --all` at random moments.
poll_flip: one connection between two socat-like sides (one thread each, waiting in poll on
the server and select on the client, then a blocking read or a write), flipped by the same
flipper: a connection said readable must have bytes to read, or both sides may end up waiting
in their reads for good.
epoll_flip: the same with level-triggered epoll (the client's set nested in another).
epoll_et_flip: non-blocking event loops, edge-triggered epoll on the server and one-shot on
the client: reads and writes until EAGAIN; a lost wake-up on either path hangs them.
Each side checks the sha256 of everything it received against what the other side sent, and
exact EOF. Under kernel TCP the triggers are no-ops (fd passing) or absent (no region)."""

import array
import hashlib
import os
import random
import select
import socket
import subprocess
import sys
import threading

from semlib import Fail, dial, eq, run

MAX_BYTES = 1 << 19
# Write sizes, drawn at random (the reader regenerates the stream from the same seed).
PIECES = [1, 7, 100, 1500, 4096, 65536, 300000]


def self_pass(sock):
    """Sends the socket's fd to ourselves with SCM_RIGHTS and closes the copy received."""
    a, b = socket.socketpair()
    try:
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sock.fileno()]))])
        _, fds, _, _ = socket.recv_fds(b, 1, 4)
        for fd in fds:
            os.close(fd)
    finally:
        a.close()
        b.close()


def stream(sock, seed, n, trigger_at):
    """Sends n random bytes in random pieces (and passes the fd once at `trigger_at` bytes);
    returns the sha256 sent. Shuts down the write side at the end."""
    rnd = random.Random(seed)
    h = hashlib.sha256()
    sent = 0
    passed = False
    while sent < n:
        k = min(n - sent, rnd.choice(PIECES))
        b = rnd.randbytes(k)
        h.update(b)
        sock.sendall(b)
        sent += k
        if not passed and sent >= trigger_at:
            self_pass(sock)
            passed = True
    sock.shutdown(socket.SHUT_WR)
    return h.hexdigest()


LAST = bytearray()


def drain(sock, keep=None):
    keep = LAST if keep is None else keep
    h = hashlib.sha256()
    n = 0
    keep.clear()
    while True:
        b = sock.recv(1 << 16)
        if not b:
            return h.hexdigest(), n
        h.update(b)
        keep.extend(b)
        n += len(b)


def expected(seed, n):
    r = random.Random(seed)
    out = bytearray()
    while len(out) < n:
        k = min(n - len(out), r.choice(PIECES))
        out.extend(r.randbytes(k))
    return bytes(out)


def first_difference(seed, n, got=None):
    want = expected(seed, n)
    got = bytes(LAST if got is None else got)
    i = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), None)
    if i is None:
        return f"no difference in {len(got)} bytes"
    return (f"first difference at byte {i} of {n}: got {got[i:i+12].hex()} want "
            f"{want[i:i+12].hex()}; got ...{got[max(0,i-8):i].hex()}")


def exchange(sock, seed, mine, trigger_at, keep=None):
    """Both directions at once; returns (sha sent, sha received, bytes received)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(sent=stream(sock, seed, mine, trigger_at)))
    t.start()
    got, n = drain(sock, keep)
    t.join(60)
    if t.is_alive():
        raise Fail("the writer never finished")
    return out["sent"], got, n


def sizes(i):
    rnd = random.Random(i)
    return rnd.randrange(1, MAX_BYTES), rnd.randrange(1, MAX_BYTES)


def count(args):
    return int(args.extra or 200)


def storm_one(sock, i, trigger_seed, mine, theirs, peer):
    """One storm connection: our stream (seed, size) out, the peer's checked against its seed
    (the reader regenerates it); our fd passed to ourselves once at a random byte."""
    (my_seed, my_size), (their_seed, their_size) = mine, theirs
    trigger_at = random.Random(trigger_seed + i).randrange(0, my_size + 1)
    sent, got, n = exchange(sock, my_seed + i, my_size, trigger_at)
    eq(n, their_size, f"conn {i}: bytes from the {peer}")
    if got != hashlib.sha256(expected(their_seed + i, their_size)).hexdigest():
        raise Fail(f"conn {i}: sha256 of the {peer}'s stream differs: "
                   f"{first_difference(their_seed + i, their_size)}")
    sock.close()


def storm_server(lsock, args):
    for i in range(count(args)):
        conn, _ = lsock.accept()
        c2s, s2c = sizes(i)
        storm_one(conn, i, 1000, (2000, s2c), (3000, c2s), "client")


DEMOTER_LOG = open(os.environ.get("STORM_DEMOTER_LOG", os.devnull), "ab")  # noqa: SIM115


def demoter(stop):
    bin_ = os.environ.get("MEMLOOP_BIN")
    if not bin_ or not os.environ.get("MEMLOOP_REGION"):
        return
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    rnd = random.Random(7)
    while not stop.wait(rnd.uniform(0.001, 0.02)):
        subprocess.run([bin_, "demote", "--all", "--wait", "0"], env=env,
                       stdout=subprocess.DEVNULL, stderr=DEMOTER_LOG, check=False)


def storm_client(args):
    stop = threading.Event()
    d = threading.Thread(target=demoter, args=(stop,), daemon=True)
    d.start()
    try:
        for i in range(count(args)):
            s = dial(args)
            c2s, s2c = sizes(i)
            storm_one(s, i, 4000, (3000, c2s), (2000, s2c), "server")
    finally:
        stop.set()


# ---- flip: few long streams, demoted and promoted back and forth ------------------------------

FLIP_BYTES = int(os.environ.get("FLIP_MB", "96")) << 20


def flip_one(sock, i, mine, theirs, peer, errors):
    """One flip connection: both streams at once, the peer's checked against its seed."""
    try:
        data = bytearray()
        sent, got, m = exchange(sock, mine + i, FLIP_BYTES, FLIP_BYTES + 1, data)
        eq(m, FLIP_BYTES, f"flip conn {i}: bytes from the {peer}")
        if got != hashlib.sha256(expected(theirs + i, FLIP_BYTES)).hexdigest():
            raise Fail(f"flip conn {i}: the {peer}'s stream differs: "
                       f"{first_difference(theirs + i, FLIP_BYTES, data)}")
        sock.close()
    except BaseException as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")


def flip_server(lsock, args):
    n = int(args.extra or 4)
    conns = [lsock.accept()[0] for _ in range(n)]
    errors = []

    ts = [threading.Thread(target=flip_one, args=(c, i, 5000, 6000, "client", errors))
          for i, c in enumerate(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errors:
        raise Fail("; ".join(errors))


def flipper(stop):
    """Demotes every connection on its ring, then promotes every one on TCP, and again, with
    random pauses (0-2 ms) between: each connection flips as fast as its two processes follow
    (a command finds some of them still switching: those it leaves alone)."""
    bin_ = os.environ.get("MEMLOOP_BIN")
    if not bin_ or not os.environ.get("MEMLOOP_REGION"):
        return
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MEMLOOP_LOG")}
    rnd = random.Random(11)
    i = 0
    while not stop.wait(rnd.uniform(0.0, 0.002)):
        verb = ["demote", "promote"][i % 2]
        subprocess.run([bin_, verb, "--all", "--wait", "0"], env=env,
                       stdout=subprocess.DEVNULL, stderr=DEMOTER_LOG, check=False)
        i += 1


def flip_client(args):
    n = int(args.extra or 4)
    # The flipper runs as a small process of its own, without the library: forking this
    # big one for every command would slow the flips down.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    flipper_proc = subprocess.Popen([sys.executable, __file__, "flipper"], env=env,
                                    stdin=subprocess.PIPE)
    socks = [dial(args) for _ in range(n)]
    errors = []

    try:
        ts = [threading.Thread(target=flip_one, args=(s, i, 6000, 5000, "server", errors))
              for i, s in enumerate(socks)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
    finally:
        flipper_proc.stdin.close()  # its cue to stop
        flipper_proc.wait(30)
    if errors:
        raise Fail("; ".join(errors))


# ---- poll_flip: one socat-like pair flipped (one thread each: poll or select, then I/O) -------

POLL_FLIP_PIECES = int(os.environ.get("POLL_FLIP_PIECES", "2000"))


def poll_flip_pieces(seed):
    """The stream a side sends: POLL_FLIP_PIECES random pieces of 1 B - 16 KiB."""
    r = random.Random(seed)
    for _ in range(POLL_FLIP_PIECES):
        yield r.randbytes(r.randint(1, 16384))


def select_waiter(sock):
    def wait(rd, wr):
        r, w, _ = select.select([sock] if rd else [], [sock] if wr else [], [], 0.001)
        return bool(r), bool(w)
    return wait


def poll_waiter(sock):
    poller = select.poll()

    def wait(rd, wr):
        poller.register(sock, (select.POLLIN if rd else 0) | (select.POLLOUT if wr else 0))
        res = poller.poll(1)
        bits = res[0][1] if res else 0
        return (rd and bits & (select.POLLIN | select.POLLHUP | select.POLLERR) != 0,
                wr and bits & (select.POLLOUT | select.POLLERR) != 0)
    return wait


def epoll_waiter(sock, nested=False):
    """Level-triggered epoll, the interest following what the side wants (EPOLL_CTL_MOD);
    `nested`: the set sits in an outer set, which is the one waited on."""
    ep = select.epoll()
    ep.register(sock, 0)
    outer = None
    if nested:
        outer = select.epoll()
        outer.register(ep.fileno(), select.EPOLLIN)
    cur = [0]

    def wait(rd, wr):
        ev = (select.EPOLLIN if rd else 0) | (select.EPOLLOUT if wr else 0)
        if ev != cur[0]:
            ep.modify(sock, ev)
            cur[0] = ev
        if outer is not None:
            res = ep.poll(0) if outer.poll(0.001) else []
        else:
            res = ep.poll(0.001)
        bits = res[0][1] if res else 0
        return (rd and bits & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) != 0,
                wr and bits & (select.EPOLLOUT | select.EPOLLERR) != 0)
    return wait


def poll_flip_one(sock, mine, theirs, peer, wait):
    """Like socat between a pipe and the connection: one thread that waits (poll, select or
    level-triggered epoll: `wait(rd, wr)`) on the connection, then makes a blocking read when
    it says readable, or writes a piece when it says writable. A piece is made only when a wait
    ran out with nothing to do, so both sides are often idle in their waits when a switch comes.
    The kernel's rule: a connection said readable has something to read — else the blocking
    read waits for the peer's next write, and for good when the peer is in the same read (the
    scenario's watchdog ends it). Then both streams' sha256 and exact EOF."""
    pieces = poll_flip_pieces(mine)
    want = hashlib.sha256(b"".join(poll_flip_pieces(theirs))).hexdigest()
    got = hashlib.sha256()
    pending, eof, shut, n_in = b"", False, False, 0
    while not (eof and shut and not pending):
        readable, writable = wait(not eof, bool(pending))
        if not readable and not writable:
            if not pending and not shut:
                pending = next(pieces, None)
                if pending is None:
                    pending = b""
                    sock.shutdown(socket.SHUT_WR)
                    shut = True
            continue
        if readable:
            b = sock.recv(1 << 16)
            if not b:
                eof = True
            got.update(b)
            n_in += len(b)
        if writable:
            k = sock.send(pending)
            pending = pending[k:]
    eq(got.hexdigest(), want, f"sha256 of the {peer}'s stream ({n_in} bytes)")
    sock.close()


def epoll_et_flip_one(sock, mine, theirs, peer, oneshot):
    """An event loop on a non-blocking socket: edge-triggered epoll (or level-triggered
    one-shot, re-armed after each event), reads until EAGAIN on EPOLLIN, writes until EAGAIN
    and then only after EPOLLOUT; pieces made when a wait ran out. A wake-up lost on either
    path (ring or TCP) leaves data unread or a piece unsent for good: the watchdog ends it."""
    sock.setblocking(False)
    pieces = poll_flip_pieces(mine)
    want = hashlib.sha256(b"".join(poll_flip_pieces(theirs))).hexdigest()
    got = hashlib.sha256()
    pending, eof, shut, n_in, can_write = b"", False, False, 0, True
    ep = select.epoll()
    mode = select.EPOLLONESHOT if oneshot else select.EPOLLET
    ep.register(sock, select.EPOLLIN | select.EPOLLOUT | mode)
    while not (eof and shut and not pending):
        res = ep.poll(0.001)
        bits = res[0][1] if res else 0
        if bits & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not eof:
            while True:
                try:
                    b = sock.recv(1 << 16)
                except BlockingIOError:
                    break
                if not b:
                    eof = True
                    break
                got.update(b)
                n_in += len(b)
        if bits & (select.EPOLLOUT | select.EPOLLERR):
            can_write = True
        if not res and not pending and not shut:
            pending = next(pieces, None)
            if pending is None:
                pending = b""
                sock.shutdown(socket.SHUT_WR)
                shut = True
        while can_write and pending:
            try:
                pending = pending[sock.send(pending):]
            except BlockingIOError:
                can_write = False
        if oneshot and res:
            ep.modify(sock, (0 if eof else select.EPOLLIN)
                      | (select.EPOLLOUT if not can_write else 0) | mode)
    eq(got.hexdigest(), want, f"sha256 of the {peer}'s stream ({n_in} bytes)")
    sock.close()


def flipped_pair(server_loop, client_loop):
    """A (server, client) pair of one connection flipped by the flipper (run by the client)."""
    def server(lsock, args):
        conn, _ = lsock.accept()
        lsock.close()
        server_loop(conn)

    def client(args):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        flipper_proc = subprocess.Popen([sys.executable, __file__, "flipper"], env=env,
                                        stdin=subprocess.PIPE)
        try:
            client_loop(dial(args))
        finally:
            flipper_proc.stdin.close()  # its cue to stop
            flipper_proc.wait(30)
    return server, client


def flipper_main():
    stop = threading.Event()
    t = threading.Thread(target=flipper, args=(stop,))
    t.start()
    sys.stdin.read()  # until the client closes our stdin
    stop.set()
    t.join(30)


CASES = {
    "storm": (storm_server, storm_client), "flip": (flip_server, flip_client),
    "poll_flip": flipped_pair(
        lambda s: poll_flip_one(s, 7000, 8000, "client", poll_waiter(s)),
        lambda s: poll_flip_one(s, 8000, 7000, "server", select_waiter(s))),
    "epoll_flip": flipped_pair(
        lambda s: poll_flip_one(s, 7000, 8000, "client", epoll_waiter(s)),
        lambda s: poll_flip_one(s, 8000, 7000, "server", epoll_waiter(s, nested=True))),
    "epoll_et_flip": flipped_pair(
        lambda s: epoll_et_flip_one(s, 7000, 8000, "client", oneshot=False),
        lambda s: epoll_et_flip_one(s, 8000, 7000, "server", oneshot=True)),
}

if __name__ == "__main__":
    if sys.argv[1:] == ["flipper"]:
        flipper_main()
    else:
        run(CASES)
