"""sendfile as a real program makes it, for tests/pipe.rs: under `memloop run` with
MEMLOOP_PIPE_SENDFILE=1 these calls go to the pipe service (or, without one, to the kernel's
sendfile); either way every byte must arrive in order and the file offsets behave as the
kernel's.

    pipe_sendfile.py DIR

a) socket.sendfile (Python calls os.sendfile with an offset, and seeks the file at the end);
b) os.sendfile with an explicit offset: the file position stays where it was;
c) os.sendfile with no offset (None): the file position advances by what was sent;
d) a non-blocking socket nobody reads yet: short counts, then EAGAIN; then the rest as the
   reader drains it, in order.

Prints one JSON line (the bytes of each part) and exits 0, or says what was wrong and exits 1.
"""

import hashlib
import json
import os
import select
import socket
import sys
import threading

SIZE = 6 * 1024 * 1024 + 12345


def reader(sock):
    """Reads `sock` to its end on a thread; the returned function joins it: the bytes."""
    got = []

    def run():
        while True:
            b = sock.recv(1 << 20)
            if not b:
                break
            got.append(b)
        sock.close()

    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join(60)
        if t.is_alive():
            fail("the reader did not see its end in 60 s")
        return b"".join(got)

    return join


def fail(why):
    print(f"pipe_sendfile.py: FAILED: {why}", file=sys.stderr, flush=True)
    sys.exit(1)


def same(what, got, want):
    if got != want:
        first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        fail(
            f"{what}: {len(got)} bytes arrived (sha256 {hashlib.sha256(got).hexdigest()[:16]}),"
            f" want {len(want)} ({hashlib.sha256(want).hexdigest()[:16]}); first difference at"
            f" {first}"
        )


def main():
    d = sys.argv[1]
    data = os.urandom(SIZE)
    path = os.path.join(d, "data")
    with open(path, "wb") as f:
        f.write(data)
    out = {}

    # a) socket.sendfile from offset 1000.
    a, b = socket.socketpair()
    got = reader(b)
    with open(path, "rb") as f:
        sent = a.sendfile(f, offset=1000)
        if f.tell() != SIZE:
            fail(f"socket.sendfile left the file at {f.tell()}")
    a.close()
    if sent != SIZE - 1000:
        fail(f"socket.sendfile sent {sent}")
    same("socket.sendfile", got(), data[1000:])
    out["a"] = sent

    # b) os.sendfile with an explicit offset: the position stays.
    a, b = socket.socketpair()
    got = reader(b)
    want = 3_000_000
    with open(path, "rb") as f:
        f.seek(77)
        n = 0
        while n < want:
            k = os.sendfile(a.fileno(), f.fileno(), 4096 + n, want - n)
            if k <= 0:
                fail(f"os.sendfile(offset) returned {k}")
            n += k
        if f.tell() != 77:
            fail(f"os.sendfile with an offset moved the file position to {f.tell()}")
    a.close()
    same("os.sendfile(offset)", got(), data[4096 : 4096 + want])
    out["b"] = want

    # c) os.sendfile with no offset: the position advances.
    a, b = socket.socketpair()
    got = reader(b)
    with open(path, "rb") as f:
        f.seek(5)
        n = 0
        while n < SIZE - 5:
            k = os.sendfile(a.fileno(), f.fileno(), None, SIZE - 5 - n)
            if k <= 0:
                fail(f"os.sendfile(None) returned {k}")
            n += k
        if f.tell() != SIZE:
            fail(f"os.sendfile without an offset left the position at {f.tell()}")
    a.close()
    same("os.sendfile(None)", got(), data[5:])
    out["c"] = SIZE - 5

    # d) non-blocking, nobody reading at first.
    a, b = socket.socketpair()
    a.setblocking(False)
    with open(path, "rb") as f:
        # Short counts until the socket is full (the service's first one may stop at a
        # quarter of the send buffer, where the socket stops polling writable), then EAGAIN.
        n, calls, first = 0, 0, None
        while True:
            try:
                k = os.sendfile(a.fileno(), f.fileno(), n, SIZE - n)
            except BlockingIOError:
                break
            calls += 1
            if k <= 0 or calls > 64:
                fail(f"non-blocking sendfile #{calls} to a socket nobody reads: {k}")
            first = k if first is None else first
            n += k
        if first is None or not 0 < n < SIZE:
            fail(f"non-blocking sendfile to a socket nobody reads: {n} bytes before EAGAIN")
        got = reader(b)
        while n < SIZE:
            select.select([], [a], [], 10)
            try:
                n += os.sendfile(a.fileno(), f.fileno(), n, SIZE - n)
            except BlockingIOError:
                pass
            calls += 1
    a.close()
    same("non-blocking os.sendfile", got(), data)
    out["d_first"] = first
    out["d"] = SIZE
    out["d_calls"] = calls
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
