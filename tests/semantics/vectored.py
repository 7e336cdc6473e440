#!/usr/bin/env python3
"""Scatter/gather and the other data calls: writev/sendmsg/sendto against readv/recvmsg_into,
and sendmsg/writev/sendto against recvfrom/recvmsg/recv_into; FIONREAD."""

import fcntl
import os
import select
import socket
import struct
import termios

from semlib import (check, cmd, command_server, dial, eq, pattern, poll1, recv_exact, run,
                    serve_one, wait_until)


def fionread(fd):
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def vectored_server(conn, args):
    fd = conn.fileno()
    wait_until(lambda: fionread(fd) == 20, 5, "FIONREAD == 20 (all the client's writes)")
    bufs = [bytearray(3), bytearray(4), bytearray(6)]
    eq(os.readv(fd, bufs), 13, "readv length")
    eq([bytes(b) for b in bufs], [b"abc", b"defg", b"hij123"], "readv buffers")
    bufs = [bytearray(2), bytearray(10)]
    n, anc, flags, addr = conn.recvmsg_into(bufs)
    eq(n, 7, "recvmsg_into length")
    eq([bytes(bufs[0]), bytes(bufs[1][:5])], [b"45", b"67xyz"], "recvmsg_into buffers")
    eq((anc, flags), ([], 0), "recvmsg_into ancillary data and flags")
    check(addr is None, f"recvmsg_into on TCP returned an address: {addr!r}")
    # Back: three calls, the client reads them with other calls.
    eq(conn.sendmsg([b"AB", b"", b"CDE"]), 5, "sendmsg length")
    eq(os.writev(fd, [b"FG", b"HIJK"]), 6, "writev length")
    eq(conn.sendto(b"LMN", socket.MSG_NOSIGNAL, conn.getpeername()), 3, "sendto length")
    eq(conn.recv(10), b"", "EOF from the client")
    conn.close()


def vectored_client(args):
    s = dial(args)
    fd = s.fileno()
    eq(os.writev(fd, [b"ab", b"cde", b"", b"fghij"]), 10, "writev length")
    eq(s.sendmsg([b"123", b"4567"]), 7, "sendmsg length")
    eq(s.sendto(b"xyz", (args.host, args.port)), 3, "sendto length (address ignored)")
    wait_until(lambda: fionread(fd) == 14, 5, "FIONREAD == 14 (all the server's writes)")
    data, addr = s.recvfrom(4)
    eq(data, b"ABCD", "recvfrom data")
    check(addr is None, f"recvfrom on TCP returned an address: {addr!r}")
    buf = bytearray(3)
    eq(s.recv_into(buf), 3, "recv_into length")
    eq(bytes(buf), b"EFG", "recv_into data")
    data, anc, flags, addr = s.recvmsg(100)
    eq((data, anc, flags), (b"HIJKLMN", [], 0), "recvmsg")
    check(addr is None, f"recvmsg on TCP returned an address: {addr!r}")
    s.shutdown(socket.SHUT_WR)
    eq(s.recv(10), b"", "EOF")
    s.close()


N = 50_000


def fionread_client(args):
    s = dial(args)
    fd = s.fileno()
    eq(fionread(fd), 0, "FIONREAD on an idle connection")
    cmd(s, f"send {N} 31")
    wait_until(lambda: fionread(fd) == N, 5, f"FIONREAD == {N}")
    first = recv_exact(s, 1000)
    eq(fionread(fd), N - 1000, "FIONREAD after reading 1000 bytes")
    rest = recv_exact(s, N - 1000)
    eq(first + rest, pattern(N, 31), "data")
    eq(fionread(fd), 0, "FIONREAD after reading everything")
    cmd(s, "send 7 32")
    wait_until(lambda: fionread(fd) == 7, 5, "FIONREAD == 7")
    cmd(s, "shutwr")
    check(poll1(s, select.POLLRDHUP, 5000), "the peer's shutdown never showed")
    eq(fionread(fd), 7, "FIONREAD with data before EOF")
    eq(s.recv(100), pattern(7, 32), "data before EOF")
    eq(fionread(fd), 0, "FIONREAD at EOF")
    eq(s.recv(100), b"", "EOF")
    cmd(s, "close")
    s.close()


CASES = {
    "vectored_io": (serve_one(vectored_server), vectored_client),
    "fionread": (serve_one(lambda c, a: command_server(c)), fionread_client),
}

if __name__ == "__main__":
    run(CASES)
