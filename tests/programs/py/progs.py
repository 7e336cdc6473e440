#!/usr/bin/env python3
"""Small, ordinary TCP programs for the real-program suite (standard library only).

Servers print "listening HOST PORT" once bound and exit after serving --conns connections.
Clients check what comes back (length and SHA-256 of pseudo-random data) and print one JSON
line; any mismatch or error exits non-zero with a message on stderr.

  progs.py blocking-server  --host H --port P [--conns N]
  progs.py selectors-server --host H --port P [--conns N]
  progs.py asyncio-server   --host H --port P [--conns N]
  progs.py forking-server   --host H --port P [--conns N]
  progs.py prefork-server   --host H --port P [--conns N]
  progs.py echo-client      --host H --port P --bytes B [--conns C] [--seed S]
  progs.py asyncio-client   --host H --port P --bytes B [--conns C] [--seed S]
  progs.py sockopts-server  --host H --port P
  progs.py sockopts-client  --host H --port P --file F
  progs.py http-get         --base URL NAME=SHA256...
  progs.py http-keepalive   --base URL [--hold SECS] NAME=SHA256...
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import selectors
import socket
import sys
import threading
import time
import urllib.request

CHUNK = 65536


def fail(msg):
    print(f"progs.py: FAIL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def say(line):
    """One line to stdout in ONE write: forked servers share the file and must not interleave."""
    os.write(1, (line + "\n").encode())


def listening(sock):
    host, port = sock.getsockname()[:2]
    say(f"listening {host} {port}")


def bind(host, port, backlog=64):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(backlog)
    return s


# ------------------------------------------------------------------------------------------
# Servers


def blocking_server(a):
    """One connection at a time, plain blocking recv/sendall."""
    srv = bind(a.host, a.port)
    listening(srv)
    for _ in range(a.conns):
        conn, peer = srv.accept()
        say(f"accepted {peer[0]} {peer[1]}")
        buf = bytearray(CHUNK)
        total = 0
        with conn:
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                conn.sendall(memoryview(buf)[:n])
                total += n
        say(f"echoed {total}")
    srv.close()


def selectors_server(a):
    """Non-blocking sockets multiplexed with `selectors` (epoll): many clients at once."""
    sel = selectors.DefaultSelector()
    srv = bind(a.host, a.port)
    srv.setblocking(False)
    sel.register(srv, selectors.EVENT_READ, None)
    listening(srv)
    pending = {}  # conn -> bytearray still to send
    eof = set()
    done = 0
    while done < a.conns:
        for key, events in sel.select(timeout=30):
            if key.data is None:
                conn, peer = srv.accept()
                say(f"accepted {peer[0]} {peer[1]}")
                conn.setblocking(False)
                pending[conn] = bytearray()
                sel.register(conn, selectors.EVENT_READ, "conn")
                continue
            conn = key.fileobj
            out = pending[conn]
            if events & selectors.EVENT_READ and conn not in eof:
                try:
                    data = conn.recv(CHUNK)
                except BlockingIOError:
                    data = None
                if data == b"":
                    eof.add(conn)
                elif data:
                    out += data
            if out:
                try:
                    n = conn.send(out)
                    del out[:n]
                except BlockingIOError:
                    pass
            # Stop reading while the output backs up; write when there is something to write.
            want = 0
            if conn not in eof and len(out) < 4 * CHUNK:
                want |= selectors.EVENT_READ
            if out:
                want |= selectors.EVENT_WRITE
            if want == 0:
                sel.unregister(conn)
                conn.close()
                del pending[conn]
                eof.discard(conn)
                done += 1
            else:
                sel.modify(conn, want, "conn")
    say(f"served {done}")


def asyncio_server(a):
    async def main():
        done = asyncio.Event()
        served = 0

        async def handle(reader, writer):
            nonlocal served
            peer = writer.get_extra_info("peername")
            say(f"accepted {peer[0]} {peer[1]}")
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            writer.close()
            await writer.wait_closed()
            served += 1
            if served >= a.conns:
                done.set()

        server = await asyncio.start_server(handle, a.host, a.port, reuse_address=True)
        listening(server.sockets[0])
        async with server:
            await done.wait()
        say(f"served {served}")

    asyncio.run(main())


def forking_server(a):
    """socketserver.ForkingTCPServer: the parent accepts, a forked child serves the connection
    and the parent closes its copy (the classic inetd / PostgreSQL / Apache prefork pattern)."""
    import socketserver

    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            say(f"accepted {self.client_address[0]} {self.client_address[1]}")
            buf = bytearray(CHUNK)
            while True:
                n = self.request.recv_into(buf)
                if n == 0:
                    break
                self.request.sendall(memoryview(buf)[:n])

    class Server(socketserver.ForkingTCPServer):
        allow_reuse_address = True

    with Server((a.host, a.port), Echo) as srv:
        listening(srv.socket)
        for _ in range(a.conns):
            srv.handle_request()
        # Reap the children: each served one connection.
        while srv.active_children:
            srv.collect_children(blocking=True)
    say(f"served {a.conns}")


def prefork_server(a):
    """The parent listens and forks two workers that each accept() on the inherited socket
    (nginx, Apache prefork, gunicorn); the parent only counts what they served."""
    import signal

    srv = bind(a.host, a.port)
    listening(srv)
    r, w = os.pipe()
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                while True:
                    conn, peer = srv.accept()
                    say(f"accepted {peer[0]} {peer[1]} by {os.getpid()}")
                    buf = bytearray(CHUNK)
                    with conn:
                        while True:
                            n = conn.recv_into(buf)
                            if n == 0:
                                break
                            conn.sendall(memoryview(buf)[:n])
                    os.write(w, b"x")
            except BaseException as e:  # noqa: BLE001 - report anything, then leave
                say(f"worker {os.getpid()}: {e!r}")
                os._exit(1)
        pids.append(pid)
    os.close(w)
    served = 0
    while served < a.conns:
        d = os.read(r, 64)
        if not d:
            fail(f"workers gone after {served} connections")
        served += len(d)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    say(f"served {served}")


# ------------------------------------------------------------------------------------------
# Clients


def payload(seed, nbytes):
    """Deterministic pseudo-random bytes cut into random-sized pieces (1 B .. 64 KiB)."""
    rng = random.Random(seed)
    left = nbytes
    while left > 0:
        n = min(left, rng.choice((1, 7, 100, 1460, 4096, 16384, 65536, rng.randint(1, 65536))))
        yield rng.randbytes(n)
        left -= n


def echo_once(host, port, nbytes, seed, result):
    s = socket.create_connection((host, port), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent = hashlib.sha256()
    got = hashlib.sha256()
    received = 0
    errors = []

    def writer():
        try:
            for piece in payload(seed, nbytes):
                sent.update(piece)
                s.sendall(piece)
            s.shutdown(socket.SHUT_WR)
        except OSError as e:
            errors.append(f"send: {e!r}")

    t = threading.Thread(target=writer)
    t.start()
    while True:
        data = s.recv(CHUNK)
        if not data:
            break
        got.update(data)
        received += len(data)
    t.join()
    s.close()
    result.update(
        sent=nbytes,
        received=received,
        ok=not errors and received == nbytes and sent.digest() == got.digest(),
        errors=errors,
        sha256=got.hexdigest(),
    )


def echo_client(a):
    t0 = time.monotonic()
    results = [dict() for _ in range(a.conns)]
    threads = [
        threading.Thread(target=echo_once, args=(a.host, a.port, a.bytes, a.seed + i, results[i]))
        for i in range(a.conns)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report(a, results, time.monotonic() - t0)


def asyncio_client(a):
    async def one(i):
        reader, writer = await asyncio.open_connection(a.host, a.port)
        sent, got = hashlib.sha256(), hashlib.sha256()
        received = 0

        async def write():
            for piece in payload(a.seed + i, a.bytes):
                sent.update(piece)
                writer.write(piece)
                await writer.drain()
            writer.write_eof()

        wt = asyncio.ensure_future(write())
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            got.update(data)
            received += len(data)
        await wt
        writer.close()
        await writer.wait_closed()
        return dict(
            sent=a.bytes,
            received=received,
            ok=received == a.bytes and sent.digest() == got.digest(),
            errors=[],
            sha256=got.hexdigest(),
        )

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(a.conns))), 120)

    t0 = time.monotonic()
    results = asyncio.run(main())
    report(a, results, time.monotonic() - t0)


def report(a, results, secs):
    total = sum(r.get("received", 0) for r in results)
    ok = all(r.get("ok") for r in results)
    print(json.dumps({"ok": ok, "conns": len(results), "bytes_each": a.bytes,
                      "received_total": total, "seconds": round(secs, 3),
                      "results": results}), flush=True)
    if not ok:
        fail(f"echo mismatch: {results}")


# ------------------------------------------------------------------------------------------
# Socket semantics: addresses, options, MSG_PEEK / MSG_WAITALL, sendmsg/recvmsg, sendfile,
# half-close, timeouts. The client drives; the server answers each step.


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        d = s.recv(n - len(buf))
        if not d:
            fail(f"EOF after {len(buf)} of {n} bytes")
        buf += d
    return bytes(buf)


def sockopts_server(a):
    srv = bind(a.host, a.port)
    listening(srv)
    conn, peer = srv.accept()
    say(f"accepted {peer[0]} {peer[1]}")
    # 1. Tell the client what we see: our address and theirs.
    info = json.dumps({"sockname": list(conn.getsockname()), "peername": list(peer)}).encode()
    conn.sendall(len(info).to_bytes(4, "big") + info)
    # 2. MSG_PEEK must not consume; MSG_WAITALL must return everything asked for.
    peek = conn.recv(5, socket.MSG_PEEK)
    hello = recv_exact(conn, 5)
    if peek != hello[: len(peek)] or hello != b"hello":
        fail(f"peek {peek!r} vs read {hello!r}")
    block = conn.recv(100000, socket.MSG_WAITALL)
    if len(block) != 100000:
        fail(f"MSG_WAITALL returned {len(block)} of 100000")
    conn.sendall(hashlib.sha256(block).digest())
    # 3. recvmsg of a sendmsg with several buffers.
    data, _, _, _ = conn.recvmsg(65536)
    while len(data) < 30:
        more, _, _, _ = conn.recvmsg(65536)
        if not more:
            break
        data += more
    if data != b"part1-" * 3 + b"part2-" * 2:
        fail(f"sendmsg/recvmsg: {data!r}")
    conn.sendmsg([b"ok:", b"sendmsg"])
    # 4. socket.sendfile (os.sendfile underneath) of a file the client checks.
    with open(a.file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        conn.sendall(size.to_bytes(8, "big"))
        sent = conn.sendfile(f)
    if sent != size:
        fail(f"sendfile sent {sent} of {size}")
    # 5. Half-close: the client shuts down writing; we read EOF, then still send a goodbye.
    rest = conn.recv(10)
    if rest != b"":
        fail(f"expected EOF after the client's shutdown, got {rest!r}")
    conn.sendall(b"goodbye")
    conn.close()
    srv.close()
    say("sockopts-server ok")


def sockopts_client(a):
    s = socket.create_connection((a.host, a.port), timeout=30)
    checks = {}
    # Options a program typically sets and reads back.
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    checks["nodelay"] = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    checks["keepalive"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
    checks["so_error"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    checks["so_type"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM
    # 1. Addresses as each side sees them.
    n = int.from_bytes(recv_exact(s, 4), "big")
    info = json.loads(recv_exact(s, n))
    mine, theirs = s.getsockname(), s.getpeername()
    checks["peername"] = list(theirs) == [a.host, a.port]
    checks["server_sockname"] = info["sockname"] == [a.host, a.port]
    checks["server_sees_our_address"] = info["peername"] == list(mine)
    # 2. MSG_PEEK / MSG_WAITALL on the server side.
    s.sendall(b"hel")
    time.sleep(0.05)
    s.sendall(b"lo")
    block = os.urandom(100000)
    for i in range(0, len(block), 7000):
        s.sendall(block[i : i + 7000])
    checks["waitall_digest"] = recv_exact(s, 32) == hashlib.sha256(block).digest()
    # 3. sendmsg with several buffers.
    s.sendmsg([b"part1-"] * 3 + [b"part2-"] * 2)
    checks["recvmsg_reply"] = recv_exact(s, 10) == b"ok:sendmsg"
    # 4. sendfile on the server.
    size = int.from_bytes(recv_exact(s, 8), "big")
    h = hashlib.sha256()
    left = size
    while left:
        d = s.recv(min(left, CHUNK))
        if not d:
            break
        h.update(d)
        left -= len(d)
    with open(a.file, "rb") as f:
        checks["sendfile_digest"] = left == 0 and h.digest() == hashlib.sha256(f.read()).digest()
    # 5. A receive timeout (poll with a timeout underneath): the server now waits for our EOF,
    # so nothing may arrive. Then half-close: the server sees EOF and still says goodbye.
    s.settimeout(0.3)
    try:
        early = s.recv(1)
        checks["recv_timeout"] = False
        print(f"unexpected {early!r} before the half-close", file=sys.stderr)
    except socket.timeout:
        checks["recv_timeout"] = True
    s.shutdown(socket.SHUT_WR)
    s.settimeout(10)
    tail = b""
    while True:
        d = s.recv(100)
        if not d:
            break
        tail += d
    checks["half_close"] = tail == b"goodbye"
    s.close()
    print(json.dumps({"ok": all(checks.values()), "checks": checks, "mine": list(mine),
                      "server_info": info}), flush=True)
    if not all(checks.values()):
        fail(f"socket semantics: {checks} (server saw {info}, we are {list(mine)})")


# ------------------------------------------------------------------------------------------


def http_get(a):
    """urllib: one connection per file (urllib asks the server to close)."""
    t0 = time.monotonic()
    results = {}
    for item in a.files:
        name, want = item.split("=", 1)
        with urllib.request.urlopen(f"{a.base}/{name}", timeout=60) as r:
            body = r.read()
            length = r.headers.get("Content-Length")
        got = hashlib.sha256(body).hexdigest()
        results[name] = {"bytes": len(body), "ok": got == want and str(len(body)) == length}
    http_report(results, t0)


def http_keepalive(a):
    """http.client: every file twice on ONE persistent HTTP/1.1 connection, which then stays
    open (idle) for --hold seconds, as a browser or a connection pool keeps it."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(a.base)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.connect()
    sock = conn.sock
    results = {}
    for rnd in range(2):
        for item in a.files:
            name, want = item.split("=", 1)
            conn.request("GET", f"/{name}")
            r = conn.getresponse()
            body = r.read()
            ok = (r.status == 200 and hashlib.sha256(body).hexdigest() == want
                  and conn.sock is sock and not r.will_close)
            results[f"{name}#{rnd}"] = {"bytes": len(body), "ok": ok, "status": r.status}
    time.sleep(a.hold)
    conn.close()
    http_report(results, t0)


def http_report(results, t0):
    ok = all(r["ok"] for r in results.values())
    print(json.dumps({"ok": ok, "files": results, "seconds": round(time.monotonic() - t0, 3)}),
          flush=True)
    if not ok:
        fail(f"http: {results}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("blocking-server", "selectors-server", "asyncio-server", "forking-server",
                 "prefork-server", "sockopts-server"):
        sp = sub.add_parser(name)
        sp.add_argument("--host", required=True)
        sp.add_argument("--port", type=int, required=True)
        sp.add_argument("--conns", type=int, default=1)
        sp.add_argument("--file")
    for name in ("echo-client", "asyncio-client", "sockopts-client"):
        sp = sub.add_parser(name)
        sp.add_argument("--host", required=True)
        sp.add_argument("--port", type=int, required=True)
        sp.add_argument("--bytes", type=int, default=1 << 20)
        sp.add_argument("--conns", type=int, default=1)
        sp.add_argument("--seed", type=int, default=1)
        sp.add_argument("--file")
    for name in ("http-get", "http-keepalive"):
        sp = sub.add_parser(name)
        sp.add_argument("--base", required=True)
        sp.add_argument("--hold", type=float, default=0.0)
        sp.add_argument("files", nargs="+", metavar="NAME=SHA256")
    a = p.parse_args()
    {
        "blocking-server": blocking_server,
        "selectors-server": selectors_server,
        "asyncio-server": asyncio_server,
        "forking-server": forking_server,
        "prefork-server": prefork_server,
        "echo-client": echo_client,
        "asyncio-client": asyncio_client,
        "sockopts-server": sockopts_server,
        "sockopts-client": sockopts_client,
        "http-get": http_get,
        "http-keepalive": http_keepalive,
    }[a.cmd](a)


if __name__ == "__main__":
    main()
