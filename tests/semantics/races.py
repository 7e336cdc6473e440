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
4 MiB each way with the same sha256 and an exact EOF."""

import os
import subprocess
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


CASES = {
    "stale_sweep": (stale_server, stale_client),
}

if __name__ == "__main__":
    run(CASES)
