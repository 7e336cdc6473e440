#!/usr/bin/env python3
"""Event-loop programs: an asyncio streams echo server with concurrent asyncio clients, and a
selectors-based non-blocking echo server with 20 concurrent (threaded) clients."""

import asyncio
import hashlib
import selectors
import socket
import threading

from semlib import Fail, check, dial, eq, pattern, recv_exact, run

ASYNC_CLIENTS = 10
LINES = 200
SEL_CLIENTS = 20
BLOCK = 4096
BLOCKS = 25


# ---- asyncio_echo ------------------------------------------------------------------------------

def asyncio_server(lsock, args):
    async def main():
        done = asyncio.Event()
        finished = [0]

        async def handle(reader, writer):
            while True:
                line = await reader.readline()
                if not line:
                    break
                writer.write(line)
                await writer.drain()
            writer.close()
            await writer.wait_closed()
            finished[0] += 1
            if finished[0] == ASYNC_CLIENTS:
                done.set()

        server = await asyncio.start_server(handle, sock=lsock)
        async with server:
            await asyncio.wait_for(done.wait(), 30)

    asyncio.run(main())


def asyncio_client(args):
    async def one(i):
        reader, writer = await asyncio.open_connection(args.host, args.port)
        for k in range(LINES):
            line = f"{i} {k} {pattern(40, i * 1000 + k).hex()}\n".encode()
            writer.write(line)
            await writer.drain()
            eq(await reader.readline(), line, f"echo of line {k} on connection {i}")
        writer.write_eof()
        eq(await reader.read(), b"", f"EOF on connection {i}")
        writer.close()
        await writer.wait_closed()

    async def main():
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(ASYNC_CLIENTS))), 30)

    asyncio.run(main())


# ---- selectors_echo -----------------------------------------------------------------------------

def selectors_server(lsock, args):
    sel = selectors.DefaultSelector()
    check(type(sel).__name__ == "EpollSelector", f"DefaultSelector is {type(sel).__name__}")
    lsock.setblocking(False)
    sel.register(lsock, selectors.EVENT_READ, None)
    pending = {}  # conn -> bytes waiting to be echoed
    accepted = closed = 0
    while closed < SEL_CLIENTS:
        events = sel.select(timeout=30)
        check(events, "the selector saw nothing for 30 s")
        for key, mask in events:
            if key.data is None:
                conn, _ = lsock.accept()
                conn.setblocking(False)
                accepted += 1
                pending[conn] = bytearray()
                sel.register(conn, selectors.EVENT_READ, "conn")
                continue
            conn = key.fileobj
            if mask & selectors.EVENT_READ:
                try:
                    b = conn.recv(65536)
                except BlockingIOError:
                    b = None
                if b == b"":
                    check(not pending[conn], "EOF with unechoed data")
                    sel.unregister(conn)
                    conn.close()
                    del pending[conn]
                    closed += 1
                    continue
                if b:
                    pending[conn] += b
            if pending[conn]:
                try:
                    n = conn.send(pending[conn])
                    del pending[conn][:n]
                except BlockingIOError:
                    pass
            want = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending[conn] else 0)
            if key.events != want:
                sel.modify(conn, want, "conn")
    eq(accepted, SEL_CLIENTS, "connections accepted")
    sel.close()


def selectors_client(args):
    errors = []
    start = threading.Barrier(SEL_CLIENTS)

    def one(i):
        try:
            s = dial(args)
            start.wait(10)
            h_out, h_in = hashlib.sha256(), hashlib.sha256()
            for k in range(BLOCKS):
                block = pattern(BLOCK, 700 + i * 100 + k)
                h_out.update(block)
                s.sendall(block)
                h_in.update(recv_exact(s, BLOCK, f"echo {k} on client {i}"))
            s.shutdown(socket.SHUT_WR)
            eq(s.recv(10), b"", f"EOF on client {i}")
            eq(h_in.hexdigest(), h_out.hexdigest(), f"echo sha256 on client {i}")
            s.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(SEL_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        check(not t.is_alive(), "a client thread is still running after 30 s")
    if errors:
        raise Fail("; ".join(errors))


CASES = {
    "asyncio_echo": (asyncio_server, asyncio_client),
    "selectors_echo": (selectors_server, selectors_client),
}

if __name__ == "__main__":
    run(CASES)
