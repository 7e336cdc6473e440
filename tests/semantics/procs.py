#!/usr/bin/env python3
"""Connections across fork and exec:
  fork_child_serves   the parent accepts and forks, the child serves, the parent closes its copy;
  fork_both_write     parent and child both write (and the child reads) at different times; EOF
                      only once both closed;
  exec_inherit        the accepted socket survives execv (os.set_inheritable) into a new python;
  fork_exec_inherit   fork, then execv in the child (inetd style); the parent closes its copy;
  spawn_inherit       subprocess.Popen(pass_fds=...) (vfork/posix_spawn); the parent closes;
  fork_shared_nonblock  O_NONBLOCK set by a forked child is seen by the parent (one open file).
  fork_amid_epolls    the client forks 1000 times while two other threads create and close
                      epoll sets without pause and a third streams on its ring connection;
                      each child closes the inherited epoll fd and connection and exits: none
                      may hang (a child that inherits a lock a parent thread held at the fork
                      spins for good);
The server role prints OK only once the process that served the connection succeeded.
With --extra one_cpu the forking server pins itself to one CPU first, so after fork the parent
runs on (and closes its copy) before the child has run at all."""

import os
import socket
import subprocess
import sys
import time

from semlib import (Fail, check, dial, echo_with_sha, eq, pattern, recv_all, recv_exact, run,
                    serve_one, sha, wait_child)

SIZE = 1 << 20


def in_child(fn):
    """Runs fn() in the forked child and never returns there."""
    code = 1
    try:
        fn()
        code = 0
    except Fail as e:
        print(f"FAIL child: {e}", flush=True)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def echo_client_check(s, seed):
    data = pattern(SIZE, seed)
    from semlib import with_thread

    def send():
        for i in range(0, SIZE, 65536):
            s.sendall(data[i : i + 65536])
        s.shutdown(socket.SHUT_WR)

    join = with_thread(send)
    got = recv_all(s)
    join()
    eq(len(got), SIZE + 64, "echo plus digest length")
    eq(sha(got[:SIZE]), sha(data), "sha256 of the echo")
    eq(got[SIZE:].decode(), sha(data), "the serving process's sha256")


# ---- fork_child_serves ----------------------------------------------------------------------------

def one_cpu(args):
    """--extra one_cpu: parent and child share one CPU, so the parent runs on after fork (and
    closes its copy) before the child runs at all."""
    if args.extra == "one_cpu":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def fork_serve_server(lsock, args):
    conn, _ = lsock.accept()
    one_cpu(args)
    pid = os.fork()
    if pid == 0:
        lsock.close()
        in_child(lambda: (echo_with_sha(conn), conn.close()))
    conn.close()  # the parent's copy goes at once
    lsock.close()
    eq(wait_child(pid), 0, "the serving child's exit code")


def fork_serve_client(args):
    s = dial(args)
    echo_client_check(s, 401)
    s.close()


# ---- fork_both_write ---------------------------------------------------------------------------------

def both_server(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        def child():
            eq(os.read(go_r, 1), b"g", "go")
            msg = recv_exact(conn, 11, "the client's message")
            eq(msg, b"hello-child", "message read by the child")
            conn.sendall(b"C1:" + msg)
            conn.close()
            os.write(done_w, b"d")

        in_child(child)
    conn.sendall(b"P1")
    time.sleep(0.1)
    os.write(go_w, b"g")
    eq(os.read(done_r, 1), b"d", "the child is done")
    time.sleep(0.1)  # the child closed its copy; ours keeps the connection
    conn.sendall(b"P2" + pattern(100_000, 402))
    conn.close()
    eq(wait_child(pid), 0, "the child's exit code")


def both_client(args):
    s = dial(args)
    s.sendall(b"hello-child")
    got = recv_all(s)
    eq(got[:18], b"P1C1:hello-childP2", "writes of parent and child in order")
    eq(got[18:], pattern(100_000, 402), "the parent's last write")
    s.close()


# ---- exec_inherit / fork_exec_inherit / spawn_inherit -----------------------------------------------

def handshake_server(conn):
    eq(recv_exact(conn, 6), b"before", "before exec")
    conn.sendall(b"ack1")


def handshake_client(s):
    s.sendall(b"before")
    eq(recv_exact(s, 4), b"ack1", "ack before exec")


def child_argv(fd, case):
    return [sys.executable, os.path.abspath(__file__), "exec-child", str(fd), case]


def exec_server(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    handshake_server(conn)
    fd = conn.fileno()
    os.set_inheritable(fd, True)
    sys.stdout.flush()
    os.execv(sys.executable, child_argv(fd, args.case))


def fork_exec_server(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    handshake_server(conn)
    fd = conn.fileno()
    one_cpu(args)
    pid = os.fork()
    if pid == 0:
        os.set_inheritable(fd, True)
        os.execv(sys.executable, child_argv(fd, args.case + "-child"))
    conn.close()
    eq(wait_child(pid), 0, "the exec'd child's exit code")


def spawn_server(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    handshake_server(conn)
    fd = conn.fileno()
    p = subprocess.Popen(child_argv(fd, args.case + "-child"), pass_fds=[fd])
    conn.close()
    try:
        eq(p.wait(timeout=30), 0, "the spawned child's exit code")
    except subprocess.TimeoutExpired:
        p.kill()
        raise Fail("the spawned child is still running after 30 s")


def exec_child(fd, case):
    """The program after exec: serves the inherited connection."""
    conn = socket.socket(fileno=fd)
    check(conn.getpeername(), "the inherited socket is connected")
    conn.sendall(b"ack2")
    echo_with_sha(conn)
    conn.close()


def exec_client(args):
    s = dial(args)
    handshake_client(s)
    eq(recv_exact(s, 4), b"ack2", "ack after exec")
    echo_client_check(s, 403)
    s.close()


# ---- fork_shared_nonblock: O_NONBLOCK belongs to the open file, shared with a forked child ---------

def shared_nonblock_client(args):
    import fcntl
    import struct

    from semlib import cmd, now, within

    s = dial(args)
    fd = s.fileno()
    # Bound a wrongly blocking recv: EAGAIN after 2 s at the latest.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 0))
    pid = os.fork()
    if pid == 0:
        in_child(lambda: fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL)
                                     | os.O_NONBLOCK))
    eq(wait_child(pid), 0, "the child's exit code")
    check(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK, "O_NONBLOCK set by the child")
    t0 = now()
    try:
        s.recv(10)
        raise Fail("recv returned data")
    except BlockingIOError:
        pass
    within(now() - t0, 0, 0.5, "EAGAIN at once (the child made the file non-blocking)")
    cmd(s, "close")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    eq(s.recv(10), b"", "EOF")
    s.close()


def commands(conn, args):
    from semlib import command_server

    command_server(conn)


# ---- fork_amid_epolls ---------------------------------------------------------------------------------

def epoll_churn(stop):
    import select
    while not stop.is_set():
        select.epoll().close()


def stream_out(sock, stop):
    chunk = b"x" * 65536
    while not stop.is_set():
        sock.sendall(chunk)


def fork_amid_epolls_client(args):
    import select
    import threading
    s = dial(args)  # under the preload: the process joins its region, epoll sets are tracked
    inherited = select.epoll()
    stop = threading.Event()
    busy = [threading.Thread(target=epoll_churn, args=(stop,)) for _ in range(2)]
    busy.append(threading.Thread(target=stream_out, args=(s, stop)))
    for t in busy:
        t.start()
    try:
        for i in range(1000):
            pid = os.fork()
            if pid == 0:
                # As a subprocess child does before its exec: close what it inherited.
                inherited.close()
                os.close(s.fileno())
                os._exit(0)
            deadline = time.monotonic() + 10
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    raise Fail(f"fork {i}: the child hung closing what it inherited")
                time.sleep(0.001)
    finally:
        stop.set()
        for t in busy:
            t.join()
    s.shutdown(socket.SHUT_WR)
    s.close()


def sink(conn, args):
    while conn.recv(1 << 20):
        pass
    conn.close()


CASES = {
    "fork_amid_epolls": (serve_one(sink), fork_amid_epolls_client),
    "fork_shared_nonblock": (serve_one(commands), shared_nonblock_client),
    "fork_child_serves": (fork_serve_server, fork_serve_client),
    "fork_both_write": (both_server, both_client),
    "exec_inherit": (exec_server, exec_client),
    "fork_exec_inherit": (fork_exec_server, exec_client),
    "spawn_inherit": (spawn_server, exec_client),
}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "exec-child":
        fd, case = int(sys.argv[2]), sys.argv[3]
        import faulthandler

        faulthandler.dump_traceback_later(40, exit=True)
        try:
            exec_child(fd, case)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            print(f"FAIL server {case}: {type(e).__name__}: {e}", flush=True)
            sys.exit(1)
        if not case.endswith("-child"):
            # execv replaced the server itself: this process reports for the role.
            print(f"OK server {case}", flush=True)
        sys.exit(0)
    run(CASES)
