#!/usr/bin/env python3
"""sendfile from a file to the connection: explicit offsets (file position untouched), the
file position (offset None, position advances), and socket.sendfile()."""

import os
import tempfile

from semlib import check, dial, eq, pattern, recv_all, run, serve_one, sha

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


CASES = {"sendfile": (serve_one(sendfile_server), sendfile_client)}

if __name__ == "__main__":
    run(CASES)
