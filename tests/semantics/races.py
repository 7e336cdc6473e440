#!/usr/bin/env python3
"""Races of live path switching, put in one order by `MEMLOOP_TEST_PAUSE`
(crates/memloop-preload/src/testpoint.rs): each was found by a storm, losing it takes a window
of microseconds in the wild, and here it is lost on every run. On kernel TCP (the reference)
the same programs run without pauses.

stale_sweep: the heartbeat's switch sweep lists the connections of its process, then (paused)
the program closes connection A on both sides and opens B, which takes A's channel slot and,
in the server, A's fd number; B is asked to leave its ring (`memloop demote --all`) while the
server is in none of its calls on B. The sweep then resumes with A in its list. A step taken
for A there would act on B's switch words and ring a doorbell into B's socket (the `\\x01`
that redis-benchmark once read as a reply); B must instead switch as asked, and carry
4 MiB each way with the same sha256 and an exact EOF.

eof_after_leaving: the server's reader thread sleeps on its socket in a ring wait (doorbell
wake-ups: `MEMLOOP_WAKE=doorbell`) and pauses just before the sleep; meanwhile the client shuts
its side down (on the ring), and the server's main thread passes the connection to itself
(SCM_RIGHTS: a demote), so both sides take over and the client's FIN goes on TCP. The reader
then sleeps and finds that FIN. It must end the wait only, and read EOF through TCP - not take
the FIN for the client's close (which marked the client's side closed in the registry while
the client still held it: once the client's next connection took the freed slot, the server
waited for good). The registry must show the client's side open (neither closed nor dead) until it
closes."""

import json
import os
import socket
import subprocess
import threading
import time

from semlib import check, dial, eq, expect_eof, pattern, recv_exact, run, sha, with_thread

DATA = 4 << 20


def stale_server(lsock, args):
    a, _ = lsock.accept()
    eq(recv_exact(a, 2, "A's hello"), b"a?", "hello on A")
    a.sendall(b"a!")
    expect_eof(a, "the client's shutdown of A")
    a.close()
    b, _ = lsock.accept()
    lsock.close()
    # In none of our calls on B while the paused sweep resumes (see the test's timeline).
    time.sleep(1.0)
    h_in = []
    while True:
        chunk = b.recv(1 << 16)
        if not chunk:
            break
        h_in.append(chunk)
        b.sendall(chunk)
    b.sendall(sha(b"".join(h_in)).encode())
    b.close()


def stale_client(args):
    a = dial(args)
    a.sendall(b"a?")
    eq(recv_exact(a, 2, "A's answer"), b"a!", "answer on A")
    time.sleep(0.3)  # the server's sweep has listed A and is paused
    # Closed on both sides before B is made, the server's side first: the channel is freed at
    # our close, and B's offer takes the same slot.
    a.shutdown(1)
    expect_eof(a, "the server's close of A")
    a.close()
    b = dial(args)
    if os.environ.get("MEMLOOP_REGION"):
        r = subprocess.run(
            [os.environ["MEMLOOP_BIN"], "demote", "--all", "--wait", "0"],
            capture_output=True,
            text=True,
        )
        check(r.returncode == 0, f"memloop demote --all: {r.stderr.strip()}")
    data = pattern(DATA, 11)

    def send():
        b.sendall(data)
        b.shutdown(1)

    sent = with_thread(send)
    echo = recv_exact(b, DATA, "B's echo")
    digest = recv_exact(b, 64, "the server's sha256")
    sent()
    eq(sha(echo), sha(data), "B's echo (sha256)")
    eq(digest.decode(), sha(data), "what the server received on B (sha256)")
    expect_eof(b, "B's EOF after the digest")
    b.close()


def memloop(*argv):
    """`memloop ARGV...` on this process's region (only under the preload)."""
    r = subprocess.run(
        [os.environ["MEMLOOP_BIN"], *argv], capture_output=True, text=True, check=False
    )
    check(r.returncode == 0, f"memloop {' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def eof_server(lsock, args):
    c1, _ = lsock.accept()
    lsock.close()
    got = {}

    def reader():
        got["data"] = c1.recv(100)  # its first sleep pauses (MEMLOOP_TEST_PAUSE)

    r = threading.Thread(target=reader, daemon=True)
    r.start()
    time.sleep(0.2)  # the reader is in its pause
    c1.sendall(b"shut")
    time.sleep(0.2)  # the client has shut its side down, on the ring
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(ours, [b"fd"], [c1.fileno()])  # a demote: both sides take over
    _, fds, _, _ = socket.recv_fds(theirs, 16, 1)
    os.close(fds[0])
    r.join(10)
    check(not r.is_alive(), "the reader is still blocked after the client's shutdown")
    eq(got.get("data"), b"", "the reader after the client's shutdown (EOF)")
    if os.environ.get("MEMLOOP_REGION"):
        chans = [c for c in json.loads(memloop("status", "--json"))["channels"] if not c["marker"]]
        eq(len(chans), 1, "channels in the region")
        c = chans[0]
        check(
            not (c["client_closed"] or c["client_dead"]),
            "the client still holds the connection, but the registry marks its side "
            f"closed={c['client_closed']} dead={c['client_dead']}",
        )
    c1.sendall(b"bye")
    c1.close()


def eof_client(args):
    c1 = dial(args)
    eq(recv_exact(c1, 4, "the server's cue"), b"shut", "cue")
    c1.shutdown(socket.SHUT_WR)
    eq(recv_exact(c1, 3, "the server's last word"), b"bye", "last word")
    expect_eof(c1, "the server's close")
    c1.close()


CASES = {
    "stale_sweep": (stale_server, stale_client),
    "eof_after_leaving": (eof_server, eof_client),
}

if __name__ == "__main__":
    run(CASES)
