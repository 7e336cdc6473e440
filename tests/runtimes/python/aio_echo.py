#!/usr/bin/env python3
"""aio_echo: the echo server and client of the runtime conformance suite on Python's asyncio,
as programs use it: asyncio.run, streams (start_server / open_connection), the default event
loop (a selector loop on epoll). `--loop uvloop` runs the same code on uvloop (libuv) instead.

    aio_echo.py server --port-file F [--host H] [--deadline S] [--loop asyncio|uvloop]
    aio_echo.py client --host H --port P --test echo|rr|many [--count N] [--conns N] [--bytes N]

Protocol (tests/runtimes/README.md): a connection's first byte is its command. 'E': the
server echoes every following byte until the client's EOF, then closes. 'Q': the server stops
listening and exits once its connections are done, printing "OK server ...". The client prints
"OK client <test>" when every reply matched byte for byte; anything else prints FAIL and exits
non-zero. A watchdog thread ends either role with exit code 3 at the deadline.
"""
import argparse
import asyncio
import faulthandler
import os
import random
import sys
import threading

ECHO_SIZES = [1, 2, 7, 100, 1000, 1460, 4096, 65535, 65536, 100003, 262144, 1 << 20]


def pattern(c, k, n):
    return random.Random(c * 1_000_003 + k).randbytes(n)


# ---- server ---------------------------------------------------------------------------------


async def server(a):
    stats = {"conns": 0, "bytes": 0}
    errors = []
    quit_ev = asyncio.Event()
    tasks = set()

    async def serve(reader, writer):
        tasks.add(asyncio.current_task())
        stats["conns"] += 1
        peer = writer.get_extra_info("peername")
        try:
            cmd = await reader.readexactly(1)
            if cmd == b"Q":
                quit_ev.set()
            elif cmd == b"E":
                while True:
                    data = await reader.read(65536)
                    if not data:
                        break
                    stats["bytes"] += len(data)
                    writer.write(data)
                    await writer.drain()
                writer.write_eof()
                await writer.drain()
            else:
                errors.append(f"{peer}: unknown command byte {cmd!r}")
        except Exception as e:  # noqa: BLE001 - every failure is reported
            errors.append(f"{peer}: {type(e).__name__}: {e}")
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{peer}: close: {type(e).__name__}: {e}")
            tasks.discard(asyncio.current_task())

    srv = await asyncio.start_server(serve, a.host, 0, backlog=512)
    port = srv.sockets[0].getsockname()[1]
    tmp = a.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.rename(tmp, a.port_file)
    await quit_ev.wait()
    srv.close()
    while tasks:
        await asyncio.sleep(0.01)
    if errors:
        raise RuntimeError("; ".join(errors[:5]) + f" ({len(errors)} error(s))")
    return f"server conns={stats['conns']} bytes={stats['bytes']}"


# ---- client ---------------------------------------------------------------------------------


async def exchange(a, c, sizes):
    """One echo connection: each message is written while its reply is read; the reply must
    equal it; then a half-close, and the server's EOF must follow with nothing before it."""
    reader, writer = await asyncio.open_connection(a.host, a.port)
    try:
        writer.write(b"E")
        for k, n in enumerate(sizes):
            msg = pattern(c, k, n)
            writer.write(msg)
            _, got = await asyncio.gather(writer.drain(), reader.readexactly(n))
            if got != msg:
                at = next(i for i in range(n) if got[i] != msg[i])
                raise RuntimeError(f"message {k} ({n} B): reply differs from byte {at} on")
        writer.write_eof()
        extra = await reader.read(64)
        if extra:
            raise RuntimeError(f"{len(extra)} unexpected byte(s) after the last reply")
    finally:
        writer.close()


async def quit_server(a):
    reader, writer = await asyncio.open_connection(a.host, a.port)
    writer.write(b"Q")
    await writer.drain()
    extra = await asyncio.wait_for(reader.read(16), 10)
    writer.close()
    if extra:
        raise RuntimeError(f"quit: {len(extra)} unexpected byte(s)")


async def client(a):
    if a.test == "echo":
        plan = [ECHO_SIZES]
    elif a.test == "rr":
        plan = [[1 + (i * 7) % 64 for i in range(a.count)]]
    elif a.test == "many":
        plan = [[a.bytes] for _ in range(a.conns)]
    else:
        raise RuntimeError(f"unknown test {a.test}")
    results = await asyncio.gather(
        *(exchange(a, c, sizes) for c, sizes in enumerate(plan)), return_exceptions=True
    )
    errors = [
        f"connection {c}: {type(r).__name__}: {r}"
        for c, r in enumerate(results)
        if isinstance(r, BaseException)
    ]
    try:
        await quit_server(a)
    except Exception as e:  # noqa: BLE001
        errors.append(f"quit: {type(e).__name__}: {e}")
    if errors:
        raise RuntimeError("; ".join(errors[:5]) + f" ({len(errors)} error(s))")
    return f"client {a.test}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file")
    p.add_argument("--test", default="echo")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--conns", type=int, default=50)
    p.add_argument("--bytes", type=int, default=256 << 10)
    p.add_argument("--deadline", type=float, default=40)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    a = p.parse_args()
    faulthandler.enable()

    def watchdog():
        print(f"FAIL {a.role}: watchdog: still running after {a.deadline} s", flush=True)
        os._exit(3)

    t = threading.Timer(a.deadline, watchdog)
    t.daemon = True
    t.start()
    factory = None
    if a.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            msg = runner.run(server(a) if a.role == "server" else client(a))
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {a.role}: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    print(f"OK {msg}", flush=True)


if __name__ == "__main__":
    main()
