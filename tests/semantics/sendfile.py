#!/usr/bin/env python3
"""sendfile from a file to the connection: explicit offsets (file position untouched), the
file position (offset None, position advances), and socket.sendfile(); splice between a pipe and
the connection, both ways."""

import os
import select
import tempfile

from semlib import check, dial, eq, pattern, poll1, recv_all, run, serve_one, sha

SIZE = 3 << 20


def sendfile_server(conn, args):
    data = pattern(SIZE, 301)
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        fd = f.fileno()
        out = conn.fileno()
        half = SIZE // 2
        os.lseek(fd, 0, os.SEEK_SET)
        sent = 0
        while sent < half:
            n = os.sendfile(out, fd, sent, half - sent)
            check(n > 0, f"sendfile returned {n}")
            sent += n
        eq(os.lseek(fd, 0, os.SEEK_CUR), 0, "file position after sendfile with offsets")
        os.lseek(fd, half, os.SEEK_SET)
        while sent < SIZE:
            n = os.sendfile(out, fd, None, SIZE - sent)
            check(n > 0, f"sendfile returned {n}")
            sent += n
        eq(os.lseek(fd, 0, os.SEEK_CUR), SIZE, "file position after sendfile without offset")
        f.seek(0)
        eq(conn.sendfile(f), SIZE, "socket.sendfile")
    conn.close()


def sendfile_client(args):
    s = dial(args)
    got = recv_all(s)
    eq(len(got), 2 * SIZE, "bytes received")
    want = sha(pattern(SIZE, 301))
    eq(sha(got[:SIZE]), want, "first copy (os.sendfile)")
    eq(sha(got[SIZE:]), want, "second copy (socket.sendfile)")
    s.close()


# ---- splice: pipe -> connection and connection -> pipe --------------------------------------------

SPLICE = 200_000


def splice_server(conn, args):
    data = pattern(SPLICE, 302)
    r, w = os.pipe()
    sent = 0
    while sent < SPLICE:
        n = os.write(w, data[sent : sent + 65536])
        k = 0
        while k < n:
            k += os.splice(r, conn.fileno(), n - k)
        sent += n
    # And back: what the client sends arrives through a pipe.
    got = b""
    while len(got) < 100:
        check(poll1(conn, select.POLLIN, 5000) & select.POLLIN, "client data never came")
        k = os.splice(conn.fileno(), w, 100 - len(got))
        check(k > 0, "EOF while splicing from the connection")
        got += os.read(r, k)
    eq(got, pattern(100, 303), "data spliced from the connection")
    conn.close()


def splice_client(args):
    s = dial(args)
    got = b""
    while len(got) < SPLICE:
        check(poll1(s, select.POLLIN, 5000) & select.POLLIN, f"stalled after {len(got)} bytes")
        b = s.recv(SPLICE - len(got))
        check(b, f"EOF after {len(got)} bytes")
        got += b
    eq(sha(got), sha(pattern(SPLICE, 302)), "data spliced into the connection")
    s.sendall(pattern(100, 303))
    check(poll1(s, select.POLLIN, 5000) & select.POLLIN, "EOF never came")
    eq(s.recv(10), b"", "EOF")
    s.close()


CASES = {
    "sendfile": (serve_one(sendfile_server), sendfile_client),
    "splice": (serve_one(splice_server), splice_client),
}

if __name__ == "__main__":
    run(CASES)
