"""Shared helpers of the socket-semantics scenarios (driven by
crates/memloop-preload/tests/semantics.rs).

Every scenario script is run twice: as `SCRIPT server --case C --host H --port-file F` and as
`SCRIPT client --case C --host H --port P`. It must behave identically on plain kernel TCP and
under the memloop preload library: the Rust driver runs it both ways. A role prints `OK <role>
<case>` and exits 0 when all its checks passed; a failed check prints `FAIL <role> <case>: why`
and exits 1. Every role is bounded by a watchdog (faulthandler: tracebacks, then exit 1).

Conventions:
  - data is deterministic: `pattern(n, seed)`; hashes with `sha(...)`;
  - the generic command server (`command_server`) lets the client drive the peer with one-line
    commands (`send N SEED [DELAY_MS]`, `shutwr`, `close`, ...), so timing-sensitive checks live
    on the client side and need no sleeps on the server side.
"""

import argparse
import ctypes
import errno
import faulthandler
import hashlib
import os
import random
import select
import socket
import sys
import threading
import time

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.recv.restype = ctypes.c_ssize_t
LIBC.send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.send.restype = ctypes.c_ssize_t
LIBC.accept4.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
LIBC.accept4.restype = ctypes.c_int


class Fail(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def eq(got, want, what):
    if got != want:
        g, w = repr(got), repr(want)
        raise Fail(f"{what}: got {g[:200]}, want {w[:200]}")


def within(elapsed, lo, hi, what):
    if not (lo <= elapsed <= hi):
        raise Fail(f"{what}: took {elapsed:.3f} s, want {lo:.3f}..{hi:.3f} s")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pattern(n, seed):
    r = random.Random(seed)
    if n <= 1 << 24:
        return r.randbytes(n)
    return b"".join(r.randbytes(min(1 << 24, n - i)) for i in range(0, n, 1 << 24))


def sha(b):
    return hashlib.sha256(b).hexdigest()


def now():
    return time.monotonic()


def wait_until(pred, timeout, what, step=0.005):
    """Polls `pred` until true; fails after `timeout` seconds."""
    end = now() + timeout
    while True:
        v = pred()
        if v:
            return v
        if now() > end:
            raise Fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def recv_exact(sock, n, what="data"):
    """Exactly n bytes (fails on EOF first)."""
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(min(n - len(buf), 1 << 20))
        if not b:
            raise Fail(f"EOF after {len(buf)} of {n} bytes of {what}")
        buf += b
    return bytes(buf)


def recv_all(sock):
    """Everything until EOF."""
    buf = bytearray()
    while True:
        b = sock.recv(1 << 20)
        if not b:
            return bytes(buf)
        buf += b


def expect_eof(sock, what="EOF"):
    b = sock.recv(100)
    eq(b, b"", what)


class Lines:
    """A line reader over a socket that keeps unread bytes (for command protocols)."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def line(self):
        while b"\n" not in self.buf:
            b = self.sock.recv(4096)
            if not b:
                if self.buf:
                    raise Fail(f"EOF inside a line: {bytes(self.buf)!r}")
                return None
            self.buf += b
        i = self.buf.index(b"\n")
        ln = bytes(self.buf[:i]).decode()
        del self.buf[: i + 1]
        return ln

    def exact(self, n):
        while len(self.buf) < n:
            b = self.sock.recv(min(n - len(self.buf), 1 << 20))
            if not b:
                raise Fail(f"EOF after {len(self.buf)} of {n} bytes")
            self.buf += b
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def cmd(sock, line):
    sock.sendall(line.encode() + b"\n")


def command_server(conn, out=None):
    """Obeys the client's one-line commands until `close` or EOF:

    send N SEED [DELAY_MS]      sleep DELAY_MS, then sendall pattern(N, SEED)
    pieces N SEED K GAP_MS      pattern(N, SEED) in K sends, GAP_MS apart
    fill SEED                   send with MSG_DONTWAIT until EAGAIN; reply via `report`
    expect N SEED [quiet]       read N bytes, check them against pattern(N, SEED), reply `ok`
    sink                        read until EOF, reply `got N SHA`, then close
    ping                        reply `pong`
    shutwr                      shutdown(SHUT_WR)
    sleep MS                    sleep
    close                       close and return

    With `out`, commands come from `conn` and everything acts on `out` (a data connection the
    client never writes to, so its own sends cannot disturb what it observes there).
    """
    data_conn = out or conn
    rd = Lines(conn)
    filled = 0
    while True:
        ln = rd.line()
        if ln is None:
            conn.close()
            if out:
                out.close()
            return
        w = ln.split()
        op = w[0]
        if op == "send":
            n, seed = int(w[1]), int(w[2])
            if len(w) > 3:
                time.sleep(int(w[3]) / 1000)
            data_conn.sendall(pattern(n, seed))
        elif op == "pieces":
            n, seed, k, gap = int(w[1]), int(w[2]), int(w[3]), int(w[4])
            data = pattern(n, seed)
            step = (n + k - 1) // k
            for i in range(0, n, step):
                if i:
                    time.sleep(gap / 1000)
                data_conn.sendall(data[i : i + step])
        elif op == "fill":
            filled = fill(data_conn, int(w[1]))
        elif op == "report":
            cmd(conn, f"filled {filled}")
        elif op == "expect":
            n, seed = int(w[1]), int(w[2])
            eq(rd.exact(n), pattern(n, seed), "data the client sent")
            if "quiet" not in w:
                cmd(conn, "ok")
        elif op == "sink":
            data = bytes(rd.buf) + recv_all(conn)
            cmd(conn, f"got {len(data)} {sha(data)}")
            conn.close()
            return
        elif op == "ping":
            cmd(conn, "pong")
        elif op == "shutwr":
            data_conn.shutdown(socket.SHUT_WR)
        elif op == "sleep":
            time.sleep(int(w[1]) / 1000)
        elif op == "close":
            conn.close()
            if out:
                out.close()
            return
        else:
            raise Fail(f"unknown command {ln!r}")


def fill(sock, seed, limit=256 << 20):
    """Sends pattern bytes with MSG_DONTWAIT until EAGAIN; returns how many went."""
    chunk = pattern(65536, seed)
    total = 0
    while total < limit:
        try:
            n = sock.send(chunk, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return total
        total += n
    raise Fail(f"send never said EAGAIN after {total} bytes")


def sockaddr(host, port):
    """(family, address) for `host` — IPv4, IPv6, or link-local IPv6 scoped as `fe80::1%eth0`
    (the scope as the interface's index: the form bind and connect take)."""
    if ":" not in host:
        return socket.AF_INET, (host, port)
    addr, _, scope = host.partition("%")
    return socket.AF_INET6, (addr, port, 0, socket.if_nametoindex(scope) if scope else 0)


def connect(host, port, timeout=10.0, **kw):
    """A connected TCP socket; retries while the peer's network is still coming up."""
    end = now() + timeout
    fam, to = sockaddr(host, port)
    while True:
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.connect(to)
            return s
        except (ConnectionRefusedError, OSError) as e:
            s.close()
            if now() > end or (isinstance(e, OSError) and e.errno not in (
                    errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH)):
                raise
            time.sleep(0.05)


def dial(args, **kw):
    """The client's connection to the server under test."""
    return connect(args.host, args.port, **kw)


def listener(host, backlog=64):
    fam, at = sockaddr(host, 0)
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if fam == socket.AF_INET6 and host == "::":
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(at)
    s.listen(backlog)
    return s


def publish_port(path, port):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.rename(tmp, path)


def libc_errno():
    return ctypes.get_errno()


def poll1(sock_or_fd, events, timeout_ms):
    """poll() on one fd: its revents (0 on timeout)."""
    p = select.poll()
    p.register(sock_or_fd, events)
    r = p.poll(timeout_ms)
    return r[0][1] if r else 0


def run(cases):
    """Entry point: `cases` maps a case name to (server_fn(listener, args), client_fn(args))."""
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["server", "client"])
    ap.add_argument("--case", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bind", default=None, help="server: address to bind (default --host)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", default=None)
    ap.add_argument("--deadline", type=float, default=40.0)
    ap.add_argument("--extra", default="", help="case-specific")
    args = ap.parse_args()
    if args.case not in cases:
        print(f"FAIL {args.role} {args.case}: unknown case", flush=True)
        sys.exit(2)
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    server_fn, client_fn = cases[args.case]
    try:
        if args.role == "server":
            lsock = listener(args.bind or args.host)
            publish_port(args.port_file, lsock.getsockname()[1])
            server_fn(lsock, args)
        else:
            client_fn(args)
    except Fail as e:
        print(f"FAIL {args.role} {args.case}: {e}", flush=True)
        sys.exit(1)
    except Exception as e:  # any unexpected error is a failure with its traceback
        import traceback

        traceback.print_exc()
        print(f"FAIL {args.role} {args.case}: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    print(f"OK {args.role} {args.case}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # do not wait for helper threads


def serve_one(fn):
    """A server function that accepts one connection and hands it to `fn(conn, args)`."""

    def server(lsock, args):
        conn, _ = lsock.accept()
        lsock.close()
        fn(conn, args)

    return server


def serve_commands(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    command_server(conn)


def serve_commands_n(n):
    """A server that accepts `n` connections and runs the command server on each (threads)."""

    def server(lsock, args):
        joins = []
        for _ in range(n):
            conn, _ = lsock.accept()
            joins.append(with_thread(command_server, conn))
        lsock.close()
        for j in joins:
            j()

    return server


def with_thread(fn, *a):
    """Runs fn(*a) in a thread; returns a join() that re-raises its exception."""
    box = {}

    def body():
        try:
            box["v"] = fn(*a)
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def join(timeout=30):
        t.join(timeout)
        if t.is_alive():
            raise Fail(f"thread {fn.__name__} still running after {timeout} s")
        if "e" in box:
            raise box["e"]
        return box.get("v")

    return join


def wait_child(pid, timeout=30):
    """The exit code of child `pid`; a child still running after `timeout` s is killed (Fail)."""
    end = time.monotonic() + timeout
    while True:
        p, status = os.waitpid(pid, os.WNOHANG)
        if p == pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise Fail(f"child {pid} still running after {timeout} s")
        time.sleep(0.01)


def echo_with_sha(sock, chunk=65536):
    """Echoes everything until EOF, then sends the sha256 of what came."""
    h = hashlib.sha256()
    while True:
        b = sock.recv(chunk)
        if not b:
            break
        h.update(b)
        sock.sendall(b)
    sock.sendall(h.hexdigest().encode())
