#!/usr/bin/env python3
"""UDP semantics. The server binds a UDP socket on the port number of its TCP listener, then
accepts the client's TCP control connection and says "R": only then does the client send
datagrams (so none can arrive before the socket is bound). Cases:
  echo          2,000 datagrams of 0..65,507 bytes echoed with sendto/recvfrom; contents and
                the source address checked both ways;
  connected     connect() on UDP: send/recv/read/write, only the peer's datagrams received
                (another socket's are dropped), connect(AF_UNSPEC) undoes it;
  peek_trunc    MSG_PEEK, MSG_TRUNC (the true length), FIONREAD (the next datagram's size),
                recvmsg's MSG_TRUNC flag, empty datagrams;
  nowait        MSG_DONTWAIT and O_NONBLOCK on an empty socket: EAGAIN; SO_RCVTIMEO ends a
                blocking receive with EAGAIN after its time;
  readiness     a receiver asleep in poll, select and a blocking recvfrom is woken by a datagram
                sent later; POLLOUT at once; a kernel fd (a pipe) in the same poll;
  vectored      sendmsg/recvmsg with several buffers, a datagram scattered and gathered;
  many_peers    eight client sockets interleaved with one server socket: each peer's datagrams
                in order, each reply to its own sender;
  mixed         one socket talks to the server and to a socket that can only use the kernel
                (it asked for IP_PKTINFO) at once: both answer, per-peer order kept;
  flood         100,000 datagrams of 1 KiB at a receiver that reads none: every send returns at
                once (never EAGAIN on a blocking socket), later the receiver gets an increasing
                subsequence of them, then a datagram sent after it drained;
  epoll         echo through a socket in an epoll set (level-triggered);
  epoll_et_sleepy  an edge-triggered epoll server asleep when each datagram comes;
  asyncio       an asyncio datagram server (its epoll loop) with eight client sockets;
  wake          receivers asleep before any peer exists (a short buffer; a peek) are woken by
                the first datagram, and nothing but it is ever seen;
  mmsg          sendmmsg of a batch and recvmmsg with MSG_WAITFORONE;
  fork          a server that forks a child which serves the socket too (the socket leaves
                its ring at the fork: every datagram is answered, by one process);
  fork_queued   inetd's 'wait' shape without exec: the server sees the socket readable but
                reads nothing, forks, and only the child reads — the datagrams queued on the
                ring at the fork reach it (their sender, asleep in a blocking recvfrom, sends
                them again by the kernel), in order, and no wake datagram is ever seen;
  inetd_exec    the same with the child exec'ing a new program on the socket as its stdin (as
                inetd starts a 'wait' service); the client waits with a timeout (poll);
  inetd_plain   the same, the new program started without the library (its environment has
                no LD_PRELOAD, as openbsd-inetd starts services);
  closed_sender a sender sends one datagram and closes its socket before the receiver looks
                (a logging client): the receiver gets it (the sender withdrew it from the ring
                the receiver had not taken and sent it by the kernel), then nothing (the wake
                datagram is never seen);
  rcvbuf        SO_RCVBUF: a socket with a large buffer (SO_RCVBUFFORCE 8 MB, set before bind)
                queues 3,000 datagrams of 1 KiB sent while it reads none, all of them, in
                order; one with a small buffer (2 KB, set after bind) keeps only a few. The
                sender stays until the receiver has read."""

import ctypes
import errno
import fcntl
import os
import select
import socket
import struct
import sys
import termios
import time

from semlib import check, eq, now, pattern, run, sockaddr, within

MAX = 65507


def udp_socket(host):
    fam, _ = sockaddr(host, 0)
    return socket.socket(fam, socket.SOCK_DGRAM)


def bind_udp(lsock, host):
    """The server's UDP socket on the TCP listener's port number."""
    fam, at = sockaddr(host, lsock.getsockname()[1])
    u = socket.socket(fam, socket.SOCK_DGRAM)
    if fam == socket.AF_INET6 and at[0] == "::":
        u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    u.bind(at)
    return u


def control(lsock):
    """Accepts the client's control connection and tells it the UDP socket is bound."""
    conn, _ = lsock.accept()
    conn.sendall(b"R")
    return conn


def dial_control(args):
    from semlib import dial

    c = dial(args)
    eq(c.recv(1), b"R", "the server's UDP socket is bound")
    return c


def wait_done(conn):
    """Until the client closes the control connection."""
    conn.settimeout(60)
    while conn.recv(64):
        pass


def server_addr(args):
    return sockaddr(args.host, args.port)[1]


def same(a, b):
    """Two socket addresses as Python reports them (IPv4-mapped and flow info aside)."""

    def norm(x):
        h = x[0]
        if h.startswith("::ffff:"):
            h = h[7:]
        return (h, x[1])

    return norm(a) == norm(b)


def datagram(i, seed=0):
    n = [0, 1, 7, 100, 1472, 9000, MAX][i % 7] if i % 3 else 1 + (i * 7919) % 4000
    return pattern(n, i + seed)


# ---- echo ------------------------------------------------------------------------------------


def echo_loop(u, until_empty=b""):
    """Echoes datagrams back to their senders until the datagram `b"end"`."""
    while True:
        d, a = u.recvfrom(70000)
        if d == b"end":
            return a
        u.sendto(d, a)


def echo_server(lsock, args):
    u = bind_udp(lsock, args.bind or args.host)
    conn = control(lsock)
    echo_loop(u)
    wait_done(conn)


def echo_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    for i in range(2000):
        d = datagram(i)
        eq(u.sendto(d, to), len(d), "sendto's return")
        got, frm = u.recvfrom(70000)
        check(same(frm, to), f"the echo comes from the server's address: {frm} vs {to}")
        eq(got, d, f"echo {i} ({len(d)} bytes)")
    u.sendto(b"end", to)
    c.close()


# ---- connected -------------------------------------------------------------------------------


def connected_server(lsock, args):
    u = bind_udp(lsock, args.bind or args.host)
    other = udp_socket(args.bind or args.host)
    conn = control(lsock)
    d, a = u.recvfrom(100)
    eq(d, b"hello", "first datagram")
    # Another socket writes to the client first: a connected client never sees it.
    other.sendto(b"intruder", a)
    u.sendto(b"from-peer", a)
    eq(u.recvfrom(100)[0], b"write", "a write() on the connected socket")
    u.sendto(b"r1", a)
    d, a2 = u.recvfrom(100)
    eq(d, b"after-unspec", "sendto after connect(AF_UNSPEC)")
    other.sendto(b"now-welcome", a2)
    wait_done(conn)


def connected_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    u.connect(to)
    eq(u.send(b"hello"), 5, "send on a connected socket")
    eq(u.recv(100), b"from-peer", "only the peer's datagram (the other was dropped)")
    eq(os.write(u.fileno(), b"write"), 5, "write()")
    eq(os.read(u.fileno(), 100), b"r1", "read()")
    # Disconnect (AF_UNSPEC), then anyone may write to us again.
    sa = struct.pack("H", socket.AF_UNSPEC) + b"\0" * 14
    libc = ctypes.CDLL(None, use_errno=True)
    eq(libc.connect(u.fileno(), sa, len(sa)), 0, "connect(AF_UNSPEC)")
    u.sendto(b"after-unspec", to)
    d, _ = u.recvfrom(100)
    eq(d, b"now-welcome", "a datagram from a third socket after the disconnect")
    c.close()


# ---- peek / trunc ----------------------------------------------------------------------------


def cmd_server(lsock, args):
    """Sends what the client asks for: `N SEED [DELAY_MS]` → a datagram of N bytes (after
    DELAY_MS); `END` stops."""
    u = bind_udp(lsock, args.bind or args.host)
    conn = control(lsock)
    while True:
        d, a = u.recvfrom(100)
        if d == b"END":
            break
        n, seed, *ms = map(int, d.split())
        time.sleep(ms[0] / 1000 if ms else 0)
        u.sendto(pattern(n, seed), a)
    wait_done(conn)


def ioctl_int(fd, req):
    return struct.unpack("i", fcntl.ioctl(fd, req, b"\0\0\0\0"))[0]


def ask(u, to, n, seed):
    u.sendto(b"%d %d" % (n, seed), to)


def peek_trunc_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    ask(u, to, 1000, 5)
    ask(u, to, 0, 6)
    ask(u, to, 300, 7)
    select.select([u], [], [], 5)
    time.sleep(0.1)  # all three queued
    eq(ioctl_int(u.fileno(), termios.FIONREAD), 1000, "FIONREAD: the next datagram's size")
    eq(u.recv(10, socket.MSG_PEEK), pattern(1000, 5)[:10], "a peek")
    eq(u.recv(10, socket.MSG_PEEK), pattern(1000, 5)[:10], "a second peek: still there")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(20)
    n = libc.recv(u.fileno(), buf, 20, socket.MSG_TRUNC)
    eq(n, 1000, "MSG_TRUNC returns the datagram's true length")
    eq(buf.raw, pattern(1000, 5)[:20], "what fitted")
    d, _, flags, _ = u.recvmsg(100)
    eq((d, flags & socket.MSG_TRUNC), (b"", 0), "an empty datagram is a datagram")
    d, _, flags, _ = u.recvmsg(100)
    eq((d, flags & socket.MSG_TRUNC != 0), (pattern(300, 7)[:100], True), "recvmsg's MSG_TRUNC flag")
    u.setblocking(False)
    try:
        u.recv(10)
        check(False, "the rest of a truncated datagram is gone")
    except BlockingIOError:
        pass
    eq(ioctl_int(u.fileno(), termios.FIONREAD), 0, "FIONREAD on an empty socket")
    u.sendto(b"END", to)
    c.close()


# ---- nowait ----------------------------------------------------------------------------------


def nowait_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    ask(u, to, 10, 1)  # binds us, and one datagram comes back
    eq(u.recv(100), pattern(10, 1), "the first reply")
    try:
        u.recv(100, socket.MSG_DONTWAIT)
        check(False, "MSG_DONTWAIT on an empty socket")
    except BlockingIOError:
        pass
    u.setblocking(False)
    try:
        u.recvfrom(100)
        check(False, "O_NONBLOCK on an empty socket")
    except BlockingIOError:
        pass
    u.setblocking(True)
    u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200000))
    t0 = now()
    r = ctypes.CDLL(None, use_errno=True).recv(u.fileno(), ctypes.create_string_buffer(10), 10, 0)
    eq((r, ctypes.get_errno()), (-1, errno.EAGAIN), "SO_RCVTIMEO ends the receive with EAGAIN")
    within(now() - t0, 0.15, 3, "SO_RCVTIMEO's wait")
    ask(u, to, 20, 2)
    eq(u.recv(100), pattern(20, 2), "a datagram after the timeout")
    u.sendto(b"END", to)
    c.close()


# ---- readiness -------------------------------------------------------------------------------


def readiness_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    r, w = os.pipe()
    p = select.poll()
    p.register(u, select.POLLIN | select.POLLOUT)
    u.sendto(b"1 1 0", to)
    eq(u.recv(10), pattern(1, 1), "warm-up")
    eq(p.poll(0), [(u.fileno(), select.POLLOUT)], "POLLOUT at once, no POLLIN")
    q = select.poll()
    q.register(u, select.POLLIN)
    q.register(r, select.POLLIN)
    # poll, asleep when the datagram comes
    u.sendto(b"10 2 150", to)
    t0 = now()
    ev = q.poll(5000)
    eq(ev, [(u.fileno(), select.POLLIN)], "poll woken by the datagram")
    within(now() - t0, 0.1, 4, "poll slept until it came")
    eq(u.recv(100), pattern(10, 2), "its data")
    # the pipe wakes the same poll
    os.write(w, b"x")
    eq(q.poll(1000), [(r, select.POLLIN)], "a kernel fd in the same poll")
    os.read(r, 1)
    # select
    u.sendto(b"11 3 150", to)
    t0 = now()
    rl, _, _ = select.select([u, r], [], [], 5)
    eq(rl, [u], "select woken by the datagram")
    within(now() - t0, 0.1, 4, "select slept until it came")
    eq(u.recv(100), pattern(11, 3), "its data")
    # blocking recvfrom
    u.sendto(b"12 4 150", to)
    t0 = now()
    d, a = u.recvfrom(100)
    eq(d, pattern(12, 4), "a blocking recvfrom woken by the datagram")
    within(now() - t0, 0.1, 4, "recvfrom slept until it came")
    u.sendto(b"END", to)
    c.close()


# ---- vectored --------------------------------------------------------------------------------


def vectored_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    eq(u.sendmsg([b"1000 ", b"9"], [], 0, to), 6, "sendmsg gathers its buffers")
    a, b = bytearray(300), bytearray(1000)
    n, _, flags, frm = u.recvmsg_into([a, b])
    eq(n, 1000, "recvmsg_into's length")
    eq(bytes(a) + bytes(b[:700]), pattern(1000, 9), "scattered over both buffers")
    check(same(frm, to), "the source")
    u.sendto(b"END", to)
    c.close()


# ---- many peers ------------------------------------------------------------------------------


def many_peers_client(args):
    c = dial_control(args)
    to = server_addr(args)
    socks = [udp_socket(args.host) for _ in range(8)]
    # (Small enough that eight at once fit the kernel's receive buffer: no drops there.)
    def dg(i, k):
        return pattern(1 + (i * 31 + k * 977) % 8000, i * 8 + k)

    for i in range(300):
        for k, s in enumerate(socks):
            s.sendto(dg(i, k), to)
        for k, s in enumerate(socks):
            got, frm = s.recvfrom(70000)
            eq(got, dg(i, k), f"socket {k}'s echo {i}")
    socks[0].sendto(b"end", to)
    c.close()


# ---- mixed -----------------------------------------------------------------------------------


def mixed_client(args):
    c = dial_control(args)
    to = server_addr(args)
    fam, at = sockaddr(args.host, 0)
    # A receiver that only the kernel can serve (it asks for ancillary data).
    k = socket.socket(fam, socket.SOCK_DGRAM)
    if fam == socket.AF_INET:
        k.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_PKTINFO", 8), 1)
    else:
        k.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
    k.bind(at)
    u = socket.socket(fam, socket.SOCK_DGRAM)
    for i in range(500):
        u.sendto(datagram(i), to)
        u.sendto(b"k%d" % i, k.getsockname())
        d, frm = k.recvfrom(100)
        eq(d, b"k%d" % i, f"the kernel-only socket's datagram {i}, in order")
        k.sendto(b"K%d" % i, frm)
        got = {}
        for _ in range(2):
            d, frm = u.recvfrom(70000)
            got["server" if same(frm, to) else "kernel"] = d
        eq(got, {"server": datagram(i), "kernel": b"K%d" % i}, f"both answers {i}")
    u.sendto(b"end", to)
    c.close()


# ---- flood -----------------------------------------------------------------------------------


def flood_server(lsock, args):
    u = bind_udp(lsock, args.bind or args.host)
    conn = control(lsock)
    eq(conn.recv(10), b"F", "the flood is over")
    u.setblocking(False)
    seen = []
    while True:
        try:
            d, a = u.recvfrom(2000)
        except BlockingIOError:
            break
        seen.append(struct.unpack("I", d[:4])[0])
    check(seen, "some datagrams of the flood arrived")
    check(all(x < y for x, y in zip(seen, seen[1:])), "an increasing subsequence: no reordering")
    check(len(seen) < 100000 or True, "(drops allowed)")
    conn.sendall(b"D")
    u.setblocking(True)
    u.settimeout(10)
    d, a = u.recvfrom(2000)
    eq(d, b"after", "a datagram after the receiver drained")
    conn.sendall(b"%d" % len(seen))
    wait_done(conn)


def flood_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    body = bytes(1020)
    t0 = now()
    for i in range(100000):
        eq(u.sendto(struct.pack("I", i) + body, to), 1024, "every send succeeds")
    check(now() - t0 < 30, "the sender never blocked for long")
    c.sendall(b"F")
    eq(c.recv(1), b"D", "the receiver drained")
    u.sendto(b"after", to)
    n = int(c.recv(20))
    check(0 < n <= 100000, f"{n} of 100,000 delivered")
    c.close()


# ---- epoll -----------------------------------------------------------------------------------


def epoll_server(lsock, args, et=False):
    u = bind_udp(lsock, args.bind or args.host)
    ep = select.epoll()
    ep.register(u.fileno(), select.EPOLLIN | (select.EPOLLET if et else 0))
    conn = control(lsock)
    u.setblocking(False)
    done = False
    while not done:
        for _ in ep.poll(10):
            while True:
                try:
                    d, a = u.recvfrom(70000)
                except BlockingIOError:
                    break
                if d == b"end":
                    done = True
                    break
                u.sendto(d, a)
    wait_done(conn)


def epoll_et_server(lsock, args):
    epoll_server(lsock, args, et=True)


def sleepy_client(args):
    """Echoes with pauses: the server is asleep in its wait when each datagram comes."""
    c = dial_control(args)
    u = udp_socket(args.host)
    to = server_addr(args)
    for i in range(40):
        time.sleep(0.02)
        d = datagram(i)
        u.sendto(d, to)
        got, frm = u.recvfrom(70000)
        eq(got, d, f"echo {i} after a pause")
    u.sendto(b"end", to)
    c.close()


def asyncio_server(lsock, args):
    import asyncio

    u = bind_udp(lsock, args.bind or args.host)
    u.setblocking(False)
    conn = control(lsock)

    class Echo(asyncio.DatagramProtocol):
        def __init__(self, done):
            self.done = done

        def connection_made(self, transport):
            self.t = transport

        def datagram_received(self, data, addr):
            if data == b"end":
                self.done.set_result(True)
            else:
                self.t.sendto(data, addr)

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        t, _ = await loop.create_datagram_endpoint(lambda: Echo(done), sock=u)
        await asyncio.wait_for(done, 30)
        t.close()

    asyncio.run(main())
    wait_done(conn)


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(Iovec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", Msghdr), ("len", ctypes.c_uint)]


def mmsgs(bufs):
    """An array of mmsghdrs, one iovec each over `bufs` (kept alive by the caller)."""
    arr = (Mmsghdr * len(bufs))()
    iovs = []
    for i, b in enumerate(bufs):
        iov = Iovec(ctypes.cast(b, ctypes.c_void_p), len(b))
        iovs.append(iov)
        arr[i].hdr.iov = ctypes.pointer(iov)
        arr[i].hdr.iovlen = 1
    return arr, iovs


def mmsg_client(args):
    """sendmmsg of a batch, recvmmsg of the echoes: MSG_WAITFORONE returns what is there."""
    c = dial_control(args)
    u = udp_socket(args.host)
    u.connect(server_addr(args))
    libc = ctypes.CDLL(None, use_errno=True)
    out = [ctypes.create_string_buffer(pattern(100 + i, i), 100 + i) for i in range(5)]
    arr, _keep = mmsgs(out)
    eq(libc.sendmmsg(u.fileno(), arr, 5, 0), 5, "sendmmsg sent the batch")
    eq([arr[i].len for i in range(5)], [100 + i for i in range(5)], "each message's length")
    got = []
    while len(got) < 5:
        inb = [ctypes.create_string_buffer(200) for _ in range(8)]
        rarr, _k = mmsgs(inb)
        n = libc.recvmmsg(u.fileno(), rarr, 8, 0x10000, None)  # MSG_WAITFORONE
        check(1 <= n <= 5 - len(got), f"recvmmsg with MSG_WAITFORONE returned {n}")
        got += [inb[i].raw[:rarr[i].len] for i in range(n)]
    eq(got, [pattern(100 + i, i) for i in range(5)], "the echoes, in order")
    u.setblocking(False)
    inb = [ctypes.create_string_buffer(200) for _ in range(2)]
    rarr, _k = mmsgs(inb)
    eq(libc.recvmmsg(u.fileno(), rarr, 2, 0, None), -1, "nothing more")
    eq(ctypes.get_errno(), errno.EAGAIN, "EAGAIN")
    u.sendto(b"end", server_addr(args))
    c.close()


def readable_within(u, secs):
    """Until `u` is readable, at most `secs` (a forked child's bound on its wait: a timeout
    on the socket would make the file non-blocking for the parent too)."""
    r, _, _ = select.select([u], [], [], secs)
    check(r == [u], f"a datagram within {secs} s")


def fork_server(lsock, args):
    """inetd's 'nowait' shape: a parent that forks children which use the socket too."""
    u = bind_udp(lsock, args.bind or args.host)
    conn = control(lsock)
    d, a = u.recvfrom(100)
    eq(d, b"first", "before the fork")
    u.sendto(b"r-first", a)
    pid = os.fork()
    if pid == 0:
        try:
            readable_within(u, 20)  # (the parent's watchdog thread is not in the child)
            d, a = u.recvfrom(100)
            u.sendto(b"r-" + d, a)
        finally:
            os._exit(0)
    conn.sendall(b"F")
    os.waitpid(pid, 0)
    d, a = u.recvfrom(100)
    u.sendto(b"r-" + d, a)
    wait_done(conn)


def fork_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    u.settimeout(10)
    to = server_addr(args)
    for m in (b"first", b"second", b"third"):
        if m == b"second":
            eq(c.recv(1), b"F", "the server forked")
        u.sendto(m, to)
        eq(u.recv(100), b"r-" + m, f"the answer to {m!r}, from the parent or its child")
    c.close()


QUEUED = [b"q%d" % i + b"." * (i * 300) for i in range(6)]

# The exec'd program of inetd_exec: reads len(QUEUED) datagrams from fd 0 and answers each.
INETD_CHILD = """
import socket, sys
s = socket.socket(fileno=0)
s.settimeout(20)
for _ in range(int(sys.argv[1])):
    d, a = s.recvfrom(70000)
    s.sendto(b"r-" + d, a)
"""


def queued_server(lsock, args, exec_child, plain=False):
    """Waits until the socket is readable, reads nothing, forks; only the child reads."""
    u = bind_udp(lsock, args.bind or args.host)
    conn = control(lsock)
    eq(conn.recv(1), b"S", "the client sent everything")
    r, _, _ = select.select([u], [], [], 20)
    check(r == [u], "the socket is readable")
    pid = os.fork()
    if pid == 0:
        try:
            if exec_child:
                os.dup2(u.fileno(), 0)
                env = {k: v for k, v in os.environ.items() if not (plain and k == "LD_PRELOAD")}
                argv = [sys.executable, "-c", INETD_CHILD, str(len(QUEUED))]
                os.execve(sys.executable, argv, env)
            for _ in QUEUED:
                readable_within(u, 20)  # (the parent's watchdog thread is not in the child)
                d, a = u.recvfrom(70000)
                u.sendto(b"r-" + d, a)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    eq(status, 0, "the child served every datagram")
    wait_done(conn)


def queued_client(args, timeout):
    c = dial_control(args)
    u = udp_socket(args.host)
    u.settimeout(timeout)
    for m in QUEUED:
        u.sendto(m, server_addr(args))
    c.sendall(b"S")
    for m in QUEUED:
        eq(u.recv(70000), b"r-" + m, f"the answer to {m[:2]!r}, in order")
    c.close()


def closed_sender_server(lsock, args):
    u = bind_udp(lsock, args.bind or args.host)
    conn = control(lsock)
    eq(conn.recv(1), b"S", "the client sent and closed")
    eq(u.recv(100), b"hello", "the datagram of a sender that closed")
    u.setblocking(False)
    for _ in range(3):
        nothing_queued(u)
        time.sleep(0.15)
    wait_done(conn)


def closed_sender_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    u.sendto(b"hello", server_addr(args))
    u.close()
    c.sendall(b"S")
    c.close()


def nothing_queued(s):
    """A non-blocking socket has no datagram left."""
    try:
        d = s.recv(2000)
        check(False, f"nothing else may be queued, got {d[:16]!r} ({len(d)} bytes)")
    except BlockingIOError:
        pass


def withdrawn_server(lsock, args):
    """Read while the sender, closed after saying it sent, re-sends its untaken ring by the
    kernel: a non-blocking receiver must still find every datagram, in order."""
    fam, _ = sockaddr(args.bind or args.host, 0)
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (we run as root)
    u.bind(sockaddr(args.bind or args.host, lsock.getsockname()[1])[1])
    conn = control(lsock)
    eq(conn.recv(1), b"S", "the client sent everything")
    time.sleep(0.002)  # (inside the sender's re-sending: it closes right after "S")
    u.setblocking(False)
    for i in range(3000):
        d = u.recv(2000)
        eq(d[:4], struct.pack("<I", i), f"datagram {i} of 3,000, in order")
    nothing_queued(u)
    wait_done(conn)


def withdrawn_client(args):
    c = dial_control(args)
    u = udp_socket(args.host)
    for i in range(3000):
        u.sendto(struct.pack("<I", i) + b"x" * 1020, server_addr(args))
    c.sendall(b"S")
    u.close()
    c.close()


def rcvbuf_server(lsock, args):
    fam, at = sockaddr(args.bind or args.host, 0)
    big = socket.socket(fam, socket.SOCK_DGRAM)
    big.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (we run as root)
    big.bind(sockaddr(args.bind or args.host, lsock.getsockname()[1])[1])
    small = socket.socket(fam, socket.SOCK_DGRAM)
    small.bind(at)
    small.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    conn = control(lsock)
    conn.sendall(b"%d\n" % small.getsockname()[1])
    eq(conn.recv(1), b"S", "the client sent everything")
    big.setblocking(False)
    for i in range(3000):
        d = big.recv(2000)
        eq(d[:4], struct.pack("<I", i), f"datagram {i} of 3,000 to the big buffer, in order")
    small.setblocking(False)
    got = []
    try:
        while True:
            got.append(struct.unpack("<I", small.recv(2000)[:4])[0])
    except BlockingIOError:
        pass
    check(1 <= len(got) <= 16, f"a 2 KB buffer kept {len(got)} of 3,000 datagrams")
    eq(got, sorted(got), "in order")
    conn.sendall(b"D")
    wait_done(conn)


def rcvbuf_client(args):
    c = dial_control(args)
    port2 = int(c.recv(20).split()[0])
    u = udp_socket(args.host)
    to = server_addr(args)
    for dst in (to, (to[0], port2) + to[2:]):
        for i in range(3000):
            u.sendto(struct.pack("<I", i) + b"x" * 1020, dst)
    c.sendall(b"S")
    # Open until the server has read: the queues are the rings' (a sender that closes first
    # withdraws what was not taken, and the kernel carries it: the `withdrawn` case).
    eq(c.recv(1), b"D", "the server read everything")
    u.close()
    c.close()


def wake_server(lsock, args):
    """Receivers blocked before any peer exists: a short buffer, then a peek."""
    u1 = bind_udp(lsock, args.bind or args.host)
    fam, at = sockaddr(args.bind or args.host, 0)
    u2 = socket.socket(fam, socket.SOCK_DGRAM)
    u2.bind(at)
    conn = control(lsock)
    conn.sendall(b"%d\n" % u2.getsockname()[1])
    eq(u1.recv(8), pattern(20, 1)[:8], "a short buffer, asleep before the first datagram")
    eq(u2.recv(100, socket.MSG_PEEK), pattern(30, 2), "a peek, asleep before the first datagram")
    eq(u2.recv(100), pattern(30, 2), "the peeked datagram")
    for s in (u1, u2):
        s.setblocking(False)
        nothing_queued(s)
    wait_done(conn)


def wake_client(args):
    c = dial_control(args)
    port2 = int(c.recv(20).split()[0])
    u = udp_socket(args.host)
    time.sleep(0.2)
    u.sendto(pattern(20, 1), server_addr(args))
    time.sleep(0.2)
    u.sendto(pattern(30, 2), (server_addr(args)[0], port2) + server_addr(args)[2:])
    time.sleep(0.3)
    c.close()


run({
    "echo": (echo_server, echo_client),
    "connected": (connected_server, connected_client),
    "peek_trunc": (cmd_server, peek_trunc_client),
    "nowait": (cmd_server, nowait_client),
    "readiness": (cmd_server, readiness_client),
    "vectored": (cmd_server, vectored_client),
    "many_peers": (echo_server, many_peers_client),
    "mixed": (echo_server, mixed_client),
    "flood": (flood_server, flood_client),
    "epoll": (epoll_server, echo_client),
    "epoll_et_sleepy": (epoll_et_server, sleepy_client),
    "asyncio": (asyncio_server, many_peers_client),
    "wake": (wake_server, wake_client),
    "mmsg": (echo_server, mmsg_client),
    "fork": (fork_server, fork_client),
    "fork_queued": (lambda l, a: queued_server(l, a, False), lambda a: queued_client(a, None)),
    "inetd_exec": (lambda l, a: queued_server(l, a, True), lambda a: queued_client(a, 10)),
    "inetd_plain": (lambda l, a: queued_server(l, a, True, True), lambda a: queued_client(a, 10)),
    "rcvbuf": (rcvbuf_server, rcvbuf_client),
    "closed_sender": (closed_sender_server, closed_sender_client),
    "withdrawn": (withdrawn_server, withdrawn_client),
})
