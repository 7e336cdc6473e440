#!/usr/bin/env python3
"""Peer death: the server process SIGKILLs itself (the driver expects it to die by signal 9),
and the surviving client must see EOF or ECONNRESET within 2 s of the death, never hang:
  killed_streaming      while streaming to the client (which reads everything sent before);
  killed_idle           while the client waits in epoll, then in recv;
  killed_while_sending  while the client is blocked sending to it (EPIPE or ECONNRESET).
The server writes the CLOCK_MONOTONIC time of its death next to the port file (both roles get
--port-file)."""

import errno
import os
import random
import select
import signal
import socket
import threading
import time

from semlib import Fail, check, dial, eq, pattern, run, within

CHUNK = 65536
LIMIT = 2.0


def death_file(args):
    check(args.port_file, "--port-file is needed (the death file lies next to it)")
    return args.port_file + ".death"


def die_later(args, seconds):
    def die():
        path = death_file(args)
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.rename(path + ".tmp", path)
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Timer(seconds, die)
    t.daemon = True
    t.start()


def death_time(args):
    path = death_file(args)
    end = time.monotonic() + 5
    while not os.path.exists(path):
        check(time.monotonic() < end, f"no death file {path}")
        time.sleep(0.01)
    with open(path) as f:
        return float(f.read())


def ended(args, what):
    """The survivor saw the end: it must be within LIMIT of the death."""
    t = time.monotonic()
    d = death_time(args)
    within(t - d, -0.5, LIMIT, f"{what} after the peer's death")


# ---- killed_streaming ------------------------------------------------------------------------------

def streaming_server(lsock, args):
    conn, _ = lsock.accept()
    # --extra random: die at a random moment (the slow test repeats this many times).
    die_later(args, random.uniform(0.02, 0.6) if args.extra == "random" else 0.4)
    i = 0
    while True:
        conn.sendall(pattern(CHUNK, 500 + i % 64))
        i += 1


def streaming_client(args):
    s = dial(args)
    got = bytearray()
    end_kind = None
    while True:
        try:
            b = s.recv(1 << 20)
        except ConnectionResetError:
            end_kind = "ECONNRESET"
            break
        if not b:
            end_kind = "EOF"
            break
        got += b
    ended(args, end_kind)
    check(len(got) > 0, "nothing received before the death")
    full, rest = divmod(len(got), CHUNK)
    for i in range(full):
        if got[i * CHUNK : (i + 1) * CHUNK] != pattern(CHUNK, 500 + i % 64):
            raise Fail(f"chunk {i} corrupt")
    eq(bytes(got[full * CHUNK :]), pattern(CHUNK, 500 + full % 64)[:rest], "last partial chunk")
    s.close()


# ---- killed_idle -----------------------------------------------------------------------------------

def idle_server(lsock, args):
    conn, _ = lsock.accept()
    conn.sendall(b"hi")
    die_later(args, 0.3)
    time.sleep(30)


def idle_client(args):
    s = dial(args)
    eq(s.recv(2), b"hi", "greeting")
    ep = select.epoll()
    ep.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
    evs = ep.poll(10)
    check(evs, "epoll saw nothing within 10 s of waiting for the peer's death")
    check(evs[0][1] & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR),
          f"epoll events {evs[0][1]:#x}")
    ended(args, "epoll")
    try:
        eq(s.recv(10), b"", "EOF from the dead peer")
    except ConnectionResetError:
        pass
    ep.close()
    s.close()


# ---- killed_while_sending ------------------------------------------------------------------------

def sending_server(lsock, args):
    conn, _ = lsock.accept()
    conn.sendall(b"hi")
    die_later(args, 0.5)
    time.sleep(30)


def sending_client(args):
    s = dial(args)
    eq(s.recv(2), b"hi", "greeting")
    chunk = pattern(CHUNK, 600)
    try:
        for _ in range(100_000):
            s.send(chunk, socket.MSG_NOSIGNAL)
        raise Fail("6 GB went to a dead peer")
    except (BrokenPipeError, ConnectionResetError) as e:
        ended(args, errno.errorcode.get(e.errno, str(e.errno)))
    s.close()


CASES = {
    "killed_streaming": (streaming_server, streaming_client),
    "killed_idle": (idle_server, idle_client),
    "killed_while_sending": (sending_server, sending_client),
}

if __name__ == "__main__":
    run(CASES)
