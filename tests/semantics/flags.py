#!/usr/bin/env python3
"""Less common corners of the stream semantics:
  peek_waitall   MSG_PEEK|MSG_WAITALL waits for the whole length (then the data is still there);
  shut_rd        after our own SHUT_RD, data already queued is still read, then EOF; poll shows
                 POLLIN|POLLRDHUP;
  oob            MSG_OOB: the urgent byte leaves the stream, POLLPRI and select's exceptional
                 set report it, recv(MSG_OOB) reads it;
  siocoutq       ioctl(TIOCOUTQ/SIOCOUTQ) counts bytes sent but not yet taken by the peer."""

import fcntl
import select
import socket
import struct
import termios
import time

from semlib import (check, cmd, command_server, dial, eq, fill, now, pattern, poll1, recv_all,
                    recv_exact, run, serve_one, wait_until, within)


def commands(conn, args):
    command_server(conn)


def ioctl_int(fd, req):
    return struct.unpack("i", fcntl.ioctl(fd, req, b"\0\0\0\0"))[0]


def peek_waitall_client(args):
    s = dial(args)
    t0 = now()
    cmd(s, "pieces 3000 801 3 100")
    got = s.recv(3000, socket.MSG_PEEK | socket.MSG_WAITALL)
    eq(len(got), 3000, "MSG_PEEK|MSG_WAITALL length")
    within(now() - t0, 0.15, 5, "MSG_PEEK|MSG_WAITALL waited for all pieces")
    eq(got, pattern(3000, 801), "peeked data")
    eq(recv_exact(s, 3000), pattern(3000, 801), "the data is still there")
    cmd(s, "close")
    eq(s.recv(10), b"", "EOF")
    s.close()


def shut_rd_client(args):
    s = dial(args)
    cmd(s, "send 3 802")
    wait_until(lambda: ioctl_int(s.fileno(), termios.FIONREAD) == 3, 5, "3 bytes queued")
    s.shutdown(socket.SHUT_RD)
    eq(s.recv(10), pattern(3, 802), "data queued before SHUT_RD")
    ev = poll1(s, select.POLLIN | select.POLLOUT | select.POLLRDHUP, 0)
    eq(ev, select.POLLIN | select.POLLOUT | select.POLLRDHUP, "poll after our SHUT_RD")
    eq(s.recv(10), b"", "EOF after the queued data")
    cmd(s, "close")  # our direction still works
    s.close()


def oob_server(conn, args):
    ev = poll1(conn, select.POLLPRI, 3000)
    check(ev & select.POLLPRI, f"POLLPRI never came (revents {ev:#x})")
    _, _, x = select.select([], [], [conn], 0)
    eq(x, [conn], "select's exceptional set")
    eq(conn.recv(1, socket.MSG_OOB), b"!", "the urgent byte")
    eq(recv_exact(conn, 2), b"ab", "the stream without the urgent byte")
    eq(conn.recv(10), b"", "EOF")
    conn.close()


def oob_client(args):
    s = dial(args)
    s.sendall(b"ab")
    s.send(b"!", socket.MSG_OOB)
    time.sleep(0.2)
    s.shutdown(socket.SHUT_WR)
    eq(s.recv(10), b"", "EOF")
    s.close()


def siocoutq_client(args):
    s = dial(args)
    fd = s.fileno()
    eq(ioctl_int(fd, termios.TIOCOUTQ), 0, "TIOCOUTQ on an idle connection")
    cmd(s, "ping")
    eq(recv_exact(s, 5), b"pong\n", "pong")
    cmd(s, "sleep 1000")
    cmd(s, "sink")
    time.sleep(0.1)
    total = fill(s, 803)
    check(ioctl_int(fd, termios.TIOCOUTQ) > 0, "TIOCOUTQ is 0 with the peer asleep")
    wait_until(lambda: ioctl_int(fd, termios.TIOCOUTQ) == 0, 5, "TIOCOUTQ back to 0")
    s.shutdown(socket.SHUT_WR)
    eq(recv_all(s).decode().split()[:2], ["got", str(total)], "what the server sank")
    s.close()


CASES = {
    "peek_waitall": (serve_one(commands), peek_waitall_client),
    "shut_rd": (serve_one(commands), shut_rd_client),
    "oob": (serve_one(oob_server), oob_client),
    "siocoutq": (serve_one(commands), siocoutq_client),
}

if __name__ == "__main__":
    run(CASES)
