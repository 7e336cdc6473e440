#!/usr/bin/env python3
"""A connection handed to another process or another program image, the way real servers do:
  inetd_chain          accept, fork; the child dup2s the connection onto fds 0 and 1, closes the
                       original and execs a handler; the handler forks and execs a second image
                       that echoes with os.read(0) / os.write(1), closes 0 and 1 and exits (the
                       handler waits for it, keeping its own 0 and 1 open);
  inetd_exit_no_close  the same, but both images end with os._exit(0) without closing anything;
  scm_rights_preloaded   the acceptor sends the connection to a worker (a separately exec'd
                       python that keeps LD_PRELOAD) with SCM_RIGHTS and closes its copy at once;
  scm_rights_plain_worker  the same, but the worker runs without LD_PRELOAD and MEMLOOP_*;
  scm_rights_back_to_ring  as scm_rights_preloaded, with the client's stream paced over ~2 s so
                       the connection, demoted when it was passed, can come back to its ring
                       mid-stream (the worker holds it alone once the acceptor closed its copy);
  exec_back_to_ring    the server moves the connection to TCP (it passes the fd to itself with
                       SCM_RIGHTS), then re-execs itself with the connection on fd 3; the new
                       image adopts it from its constructor and it comes back to its ring
                       mid-stream (the client's stream is paced over ~2 s);
  exec_through_plain   the server execs an image without the library (the connection leaves
                       its ring, and is pinned to TCP: that image may write on it), which execs
                       a preloaded image that serves; every byte over TCP;
  scm_rights_mmsg      as scm_rights_back_to_ring, but the fd goes with sendmmsg and comes with
                       recvmmsg (through ctypes: the C library's functions, as a C program
                       calls them);
  reexec_privsep       sshd-like: fork, the child moves the connection to fd 3 and re-execs this
                       script, which chroots into an empty directory, drops to `nobody` (root
                       only; otherwise says so and skips both) and serves;
  unread_tail          a dispatcher holds a connection it never reads: the client's bytes sent
                       while the connection is on TCP (`memloop demote`) stay unread in its
                       socket through `memloop promote` (the dispatcher's side comes back to
                       the ring with them still there: its *tail*), the client writes more on
                       the ring, then the dispatcher passes the fd with SCM_RIGHTS to a
                       preloaded worker that reads everything: tail, ring bytes, the rest of
                       the stream, each checked in order (the library carries the tail through
                       the ring when it demotes for the handoff). On kernel TCP the operator
                       steps are skipped;
  unread_tail_no_room  the same with the ring full (1 MiB of ring bytes): the unread bytes
                       cannot be carried, so the library refuses the SCM_RIGHTS message with
                       EBUSY rather than pass the fd on its ring; the dispatcher then reads them,
                       hands them to the worker itself and passes the fd again;
  unread_tail_operator as unread_tail, but `memloop demote` moves the connection to TCP before
                       the handoff, while the dispatcher is in none of its calls: its side
                       carries the tail from its heartbeat;
  slot_reuse           the client passes connection C1 to itself with SCM_RIGHTS and claims it
                       at once, closes it; C2 (its channel takes C1's slot) is passed the same
                       way and stays in flight past C1's claim time (10 s), then is claimed and
                       asked back to its ring: C1's long-claimed hold must not be given back on
                       C2's words (that pinned C2 to TCP and took one of its holders);
  oob                  an urgent byte (MSG_OOB) between two megabyte streams: the in-band bytes
                       arrive in order around it, SIOCATMARK is set at the mark, the urgent byte
                       is read out of band. (flags.py `oob` checks POLLPRI, select's exceptional
                       set and recv(MSG_OOB) on a tiny stream; this one adds the mark and a
                       stream in flight.)
  pidfd_shared         a third process (the grabber, started by the client, preloaded like it)
                       takes the client's connected socket with pidfd_getfd (`syscall(438, ...)`
                       through ctypes: Python has no wrapper; pidfd_owner_closes uses the C
                       library's `pidfd_getfd`) while the client's rx ring holds an echo it has
                       not read, and the write end of a pipe of the client's (it passes through
                       untouched: written, closed, read by the client); then client and grabber
                       take turns on the one connection (send a chunk, read its echo), each
                       chunk checked; the client shuts down and reads the server's sha256 of the
                       whole stream and EOF, the grabber then reads EOF too. It must stay on TCP
                       while two processes hold it, one of them unaware of the other;
  pidfd_owner_closes   the same, but after some turns the client closes its copy and the
                       grabber carries on alone (paced over ~2 s, so that the connection, held
                       by one process again, can come back to its ring), then shuts down and
                       checks the sha256 and EOF;
  pidfd_grabber_closes the same, but the grabber closes its copy after some turns and the
                       client carries on alone (paced): promoted, its TCP phase, shared with the
                       grabber, is counted from the kernel's stream positions.
  pidfd_owner_stopped  as pidfd_shared, but the grabber SIGSTOPs the client first: under the
                       preload the connection cannot leave its ring, so pidfd_getfd fails with
                       EAGAIN within MEMLOOP_PIDFD_WAIT_US (0.3 s here; counted: `memloop
                       status` pidfd_failed), never handing out a socket whose bytes are in a
                       ring; after SIGCONT a new call succeeds (on kernel TCP the first does).
  In the pidfd cases a promoter process (without the library) asks `memloop promote
  --all` every 50 ms throughout (under the preload, with MEMLOOP_BIN), and the turns are paced
  (~2 s in all).
In every case the client starts streaming before the connection reaches the program that serves
it, so bytes are in flight during the handoff; the serving image echoes everything and then the
sha256 of what it read, the client checks both and that EOF follows the last byte promptly.
The server role prints OK only once every process that served the connection exited 0. Every
helper image has its own watchdog; every wait is bounded."""

import contextlib
import ctypes
import errno
import faulthandler
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from semlib import (Fail, Lines, check, cmd, dial, echo_with_sha, eq, log, now, pattern, poll1,
                    recv_exact, run, sha, wait_child, wait_until, with_thread)

SIZE = 4 << 20
CHUNK = 65536
# Helper images run at most this long (the roles' own watchdog is at --deadline, 45 s).
HELPER_DEADLINE = 35
# How long a parent waits for the process that serves the connection.
CHILD_WAIT = 32
# EOF must follow the last byte (written just before the serving image exits) within this.
EOF_WITHIN = 3.0
SIOCATMARK = 0x8905


def wait_popen(p, what, timeout=CHILD_WAIT):
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise Fail(f"{what} still running after {timeout} s")


def helper_argv(*words):
    return [sys.executable, os.path.abspath(__file__), *map(str, words)]


def preloaded():
    with open("/proc/self/maps") as f:
        return "/libmemloop" in f.read()


# ---- the client: stream while the connection changes hands, then check the echo ---------------

def stream_client(args, seed, prefix=b"", head=b"", pause=0.0):
    """Sends `prefix` and SIZE pattern bytes at once (from a thread, so the server's handoff
    happens with bytes in flight; `pause` s between chunks), then SHUT_WR; expects `head`, the
    echo, the serving image's sha256, then EOF within EOF_WITHIN s of the last byte."""
    s = dial(args)
    s.settimeout(30)  # a stuck connection fails the case instead of waiting for the watchdog
    data = pattern(SIZE, seed)

    def send():
        s.sendall(prefix)
        for i in range(0, SIZE, CHUNK):
            s.sendall(data[i : i + CHUNK])
            time.sleep(pause)
        s.shutdown(socket.SHUT_WR)

    join = with_thread(send)
    want = len(head) + SIZE + 64
    got = recv_exact(s, want, "the echo")
    t_last = now()
    eof = s.recv(100)
    waited = now() - t_last
    eq(eof, b"", "EOF after the echo and its sha256 (no extra bytes)")
    check(waited <= EOF_WITHIN,
          f"EOF came {waited:.2f} s after the last byte, want within {EOF_WITHIN} s")
    join()
    eq(got[: len(head)], head, "what the first process wrote before the handoff")
    echo = got[len(head) : len(head) + SIZE]
    eq(len(echo), SIZE, "echo length")
    eq(sha(echo), sha(data), "sha256 of the echo (lost, duplicated or reordered bytes)")
    eq(got[len(head) + SIZE :].decode(), sha(data), "the serving image's sha256 of its input")
    s.close()


# ---- inetd_chain / inetd_exit_no_close ----------------------------------------------------------

def inetd_server(lsock, args):
    conn, _ = lsock.accept()
    pid = os.fork()
    if pid == 0:
        try:
            lsock.close()
            fd = conn.fileno()
            os.dup2(fd, 0)
            os.dup2(fd, 1)
            conn.close()  # the original fd goes; only 0 and 1 hold the connection
            env = dict(os.environ)
            if args.extra == "plain_handler":  # a handler image without the library
                env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
            os.execve(sys.executable, helper_argv("inetd-handler", args.case), env)
        finally:
            os._exit(127)
    conn.close()
    lsock.close()
    eq(wait_child(pid, CHILD_WAIT), 0, "the inetd handler's exit code")


def inetd_handler(case):
    """Image 2: forks and execs image 3 on the same fds 0 and 1, waits for it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(sys.executable, helper_argv("inetd-echo", case))
        finally:
            os._exit(127)
    code = wait_child(pid, CHILD_WAIT)
    if code != 0:
        raise Fail(f"the echo image exited {code}")
    if case == "inetd_exit_no_close":
        os._exit(0)
    os.close(0)
    os.close(1)


def inetd_echo(case):
    """Image 3: plain read(0) / write(1) echo, then the sha256 of the input."""
    h = hashlib.sha256()

    def write_all(b):
        v = memoryview(b)
        while v:
            v = v[os.write(1, v) :]

    while True:
        b = os.read(0, CHUNK)
        if not b:
            break
        h.update(b)
        write_all(b)
    write_all(h.hexdigest().encode())
    if case == "inetd_exit_no_close":
        os._exit(0)
    os.close(0)
    os.close(1)


def inetd_client(args):
    stream_client(args, 1101)


# ---- scm_rights_preloaded / scm_rights_plain_worker ---------------------------------------------

HELLO = b"HELLO\n"
ACCEPTED = b"ACCEPTED\n"


def worker_env(case):
    if case == "scm_rights_plain_worker":
        return {k: v for k, v in os.environ.items()
                if k != "LD_PRELOAD" and not k.startswith("MEMLOOP_")}
    return dict(os.environ)


# sendmmsg / recvmmsg of one message carrying one fd, through the C library (ctypes).

class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(_IoVec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_CMSG_ONE_FD = struct.calcsize("Nii") + 4  # CMSG_LEN(sizeof(int))


def _mmsg(payload, control):
    iov = _IoVec(ctypes.cast(payload, ctypes.c_void_p), len(payload))
    m = _MMsgHdr()
    m.hdr.iov = ctypes.pointer(iov)
    m.hdr.iovlen = 1
    m.hdr.control = ctypes.cast(control, ctypes.c_void_p)
    m.hdr.controllen = len(control)
    return m, iov


def send_fd_mmsg(sock, fd):
    payload = ctypes.create_string_buffer(b"fd", 2)
    cmsg = struct.pack("NiiI", _CMSG_ONE_FD, socket.SOL_SOCKET, socket.SCM_RIGHTS, fd)
    control = ctypes.create_string_buffer(cmsg + b"\0" * 4, len(cmsg) + 4)
    m, _iov = _mmsg(payload, control)
    r = _LIBC.sendmmsg(sock.fileno(), ctypes.byref(m), 1, 0)
    check(r == 1, f"sendmmsg returned {r} (errno {ctypes.get_errno()})")


def recv_fd_mmsg(sock):
    check(poll1(sock, select.POLLIN, 20000), "the passed fd arrives")
    payload = ctypes.create_string_buffer(16)
    control = ctypes.create_string_buffer(64)
    m, _iov = _mmsg(payload, control)
    r = _LIBC.recvmmsg(sock.fileno(), ctypes.byref(m), 1, socket.MSG_DONTWAIT, None)
    check(r == 1, f"recvmmsg returned {r} (errno {ctypes.get_errno()})")
    length, level, kind = struct.unpack_from("Nii", control.raw, 0)
    eq((length, level, kind), (_CMSG_ONE_FD, socket.SOL_SOCKET, socket.SCM_RIGHTS),
       "the control message")
    (fd,) = struct.unpack_from("i", control.raw, struct.calcsize("Nii"))
    return payload.raw[: m.len], [fd]


@contextlib.contextmanager
def worker_session(kind, case, timeout, env):
    """A worker process on one end of a socketpair: the other end while the worker is up and
    ready; then the worker's verdict ("ok") and its exit status 0."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(timeout)
    worker = subprocess.Popen(helper_argv(kind, case, theirs.fileno()),
                              pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    try:
        eq(ours.recv(6), b"ready\n", "the worker is up")
        yield ours
        eq(ours.recv(3), b"ok\n", "the worker's verdict")
    finally:
        code = wait_popen(worker, "the worker")
    eq(code, 0, "the worker's exit code")


def greeted(lsock):
    """The client's connection, accepted (the listener closed), hello read and answered."""
    conn, _ = lsock.accept()
    lsock.close()
    eq(recv_exact(conn, len(HELLO), "hello"), HELLO, "the client's hello")
    conn.sendall(ACCEPTED)
    return conn


def scm_server(lsock, args):
    with worker_session("scm-worker", args.case, 20, worker_env(args.case)) as ours:
        conn = greeted(lsock)
        # Let the client's stream queue up behind the hello, so the fd is passed with unread
        # bytes in it.
        wait_until(lambda: poll1(conn, select.POLLIN, 0), 5, "the client's stream")
        time.sleep(0.05)
        if args.case == "scm_rights_mmsg":
            send_fd_mmsg(ours, conn.fileno())
        else:
            socket.send_fds(ours, [b"fd"], [conn.fileno()])
        conn.close()  # the acceptor's copy goes at once


def scm_worker(case, fd):
    unix = socket.socket(fileno=fd)
    unix.settimeout(20)
    if case == "scm_rights_plain_worker" and preloaded():
        raise Fail("the plain worker has the preload library mapped")
    for k in os.environ:
        check(case != "scm_rights_plain_worker" or not k.startswith("MEMLOOP_"),
              f"{k} reached the plain worker")
    unix.sendall(b"ready\n")
    if case == "scm_rights_mmsg":
        msg, fds = recv_fd_mmsg(unix)
    else:
        msg, fds, _, _ = socket.recv_fds(unix, 16, 1)
    eq((msg, len(fds)), (b"fd", 1), "the passed connection")
    conn = socket.socket(fileno=fds[0])
    check(conn.getpeername(), "the passed socket is connected")
    echo_with_sha(conn, CHUNK)
    conn.close()
    unix.sendall(b"ok\n")
    unix.close()


def scm_client(args):
    paced = ("scm_rights_back_to_ring", "scm_rights_mmsg")
    pause = 2.0 / (SIZE // CHUNK) if args.case in paced else 0.0
    stream_client(args, 1103, prefix=HELLO, head=ACCEPTED, pause=pause)


# ---- exec_back_to_ring / exec_through_plain ---------------------------------------------------------

EXEC_FD = 3


def exec_server(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    conn.settimeout(20)
    eq(recv_exact(conn, len(HELLO), "hello"), HELLO, "the client's hello")
    conn.sendall(ACCEPTED)
    wait_until(lambda: poll1(conn, select.POLLIN, 0), 5, "the client's stream")
    if args.case == "exec_back_to_ring":
        # Off the ring first: pass the fd to ourselves (the library demotes before it goes).
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        socket.send_fds(ours, [b"fd"], [conn.fileno()])
        _, fds, _, _ = socket.recv_fds(theirs, 16, 1)
        eq(len(fds), 1, "the fd passed to ourselves")
        for fd in fds:
            os.close(fd)
        ours.close()
        theirs.close()
    pid = os.fork()
    if pid == 0:
        try:
            fd = conn.fileno()
            if fd != EXEC_FD:
                os.dup2(fd, EXEC_FD)
                conn.close()
            os.set_inheritable(EXEC_FD, True)
            env = dict(os.environ)
            if args.case == "exec_through_plain":
                env["ML_PRELOAD_AGAIN"] = env.pop("LD_PRELOAD", "")
            os.execve(sys.executable, helper_argv("exec-serve", args.case, EXEC_FD), env)
        finally:
            os._exit(127)
    conn.close()  # the exec'd image holds the connection alone
    eq(wait_child(pid, CHILD_WAIT), 0, "the exec'd image's exit code")


def exec_serve(case, fd):
    """The next image: an image without the library execs the preloaded one; that serves."""
    if "ML_PRELOAD_AGAIN" in os.environ:
        if preloaded():
            raise Fail("the plain image has the preload library mapped")
        env = dict(os.environ)
        env["LD_PRELOAD"] = env.pop("ML_PRELOAD_AGAIN")
        os.execve(sys.executable, helper_argv("exec-serve", case, fd), env)
    conn = socket.socket(fileno=fd)
    conn.settimeout(20)
    echo_with_sha(conn, CHUNK)
    conn.close()


def exec_client(args):
    pause = 2.0 / (SIZE // CHUNK)
    stream_client(args, 1107, prefix=HELLO, head=ACCEPTED, pause=pause)


# ---- reexec_privsep ---------------------------------------------------------------------------------

PRIVSEP_FD = 3


def privsep_server(lsock, args):
    conn, _ = lsock.accept()
    root = tempfile.mkdtemp(prefix="memloop-privsep-")
    pid = os.fork()
    if pid == 0:
        try:
            lsock.close()
            fd = conn.fileno()
            if fd != PRIVSEP_FD:
                os.dup2(fd, PRIVSEP_FD)
                conn.close()
            os.set_inheritable(PRIVSEP_FD, True)
            os.execv(sys.executable, helper_argv("privsep", args.case, PRIVSEP_FD, root))
        finally:
            os._exit(127)
    conn.close()
    lsock.close()
    try:
        eq(wait_child(pid, CHILD_WAIT), 0, "the re-exec'd child's exit code")
    finally:
        os.rmdir(root)


def privsep_child(case, fd, root):
    """The re-exec'd image: everything it needs is loaded; then chroot, setuid, serve."""
    import pwd

    conn = socket.socket(fileno=fd)
    check(conn.getpeername(), "the inherited socket is connected")
    if os.geteuid() == 0:
        pw = pwd.getpwnam("nobody")
        os.chroot(root)
        os.chdir("/")
        eq(os.listdir("/"), [], "the chroot is the empty directory")
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
        eq((os.getuid(), os.geteuid(), os.getgid()), (pw.pw_uid, pw.pw_uid, pw.pw_gid),
           "uid, euid, gid after dropping to nobody")
    else:
        print(f"NOTE server {case}: not root, chroot and setuid skipped", flush=True)
    echo_with_sha(conn, CHUNK)
    conn.close()


def privsep_client(args):
    stream_client(args, 1105)


# ---- oob: an urgent byte in the middle of a stream ---------------------------------------------------

OOB_HALF = 1 << 20


def at_mark(sock):
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCATMARK, b"\0\0\0\0"))[0]


def oob_server(conn, args):
    conn.settimeout(30)
    first = recv_exact(conn, OOB_HALF, "the stream before the urgent byte")
    ev = poll1(conn, select.POLLPRI, 5000)
    check(ev & select.POLLPRI, f"POLLPRI never came (revents {ev:#x})")
    eq(at_mark(conn), 1, "SIOCATMARK at the urgent byte's position")
    eq(conn.recv(1, socket.MSG_OOB), b"!", "the urgent byte")
    rest = bytearray()
    while True:
        b = conn.recv(CHUNK)
        if not b:
            break
        rest += b
    inband = first + bytes(rest)
    eq(len(inband), 2 * OOB_HALF, "in-band bytes (the urgent byte is not among them)")
    conn.sendall(f"got {len(inband)} {sha(inband)}\n".encode())
    conn.close()


def oob_client(args):
    s = dial(args)
    s.settimeout(30)
    a, b = pattern(OOB_HALF, 1107), pattern(OOB_HALF, 1108)
    s.sendall(a)
    s.send(b"!", socket.MSG_OOB)
    s.sendall(b)
    s.shutdown(socket.SHUT_WR)
    line = recv_exact(s, len(f"got {2 * OOB_HALF} {sha(b'')}\n"), "the server's verdict")
    eq(line.decode().split(), ["got", str(2 * OOB_HALF), sha(a + b)],
       "what the server read in band")
    t0 = now()
    eq(s.recv(10), b"", "EOF")
    check(now() - t0 <= EOF_WITHIN, "EOF promptly after the verdict")
    s.close()


def oob_serve(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    oob_server(conn, args)


# ---- unread_tail: a dispatcher passes on a connection it never read, through a promotion ------

TAIL_BYTES = 48 << 10  # sent on TCP, unread by the dispatcher (fits the socket's buffers)
# Sent once the connection is back on its ring: room left for the tail, or (no_room) exactly
# the ring's capacity (1 MiB by default), so the tail cannot be carried.
RING_BYTES = {"unread_tail": 200 << 10, "unread_tail_no_room": 1 << 20,
              "unread_tail_operator": 200 << 10}
REST_BYTES = 2 << 20  # sent while and after the fd changes hands
PASS_HEADER = struct.Struct(">2sQ")  # b"fd", how many bytes the dispatcher read itself


def operator(verb):
    """`memloop demote|promote --all` on the region, waiting until it is done (under the
    preload only: on kernel TCP there is nothing to move)."""
    bin_ = os.environ.get("MEMLOOP_BIN")
    if not bin_ or not os.environ.get("MEMLOOP_REGION"):
        return
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MEMLOOP_LOG")}
    r = subprocess.run([bin_, verb, "--all", "--wait", "10"], env=env, capture_output=True,
                       text=True, timeout=20, check=False)
    check(r.returncode == 0, f"memloop {verb}: exit {r.returncode}: {r.stderr.strip()}")


def tail_stream(case):
    return (pattern(TAIL_BYTES, 1201), pattern(RING_BYTES[case], 1202),
            pattern(REST_BYTES, 1203))


def tail_server(lsock, args):
    with worker_session("tail-worker", args.case, 30, dict(os.environ)) as ours:
        conn = greeted(lsock)
        # A dispatcher: it holds the connection without reading it until the client says
        # its bytes are there (and, under the preload, the demote and promote are done).
        wait_until(lambda: os.path.exists(args.port_file + ".pass"), 25, "the client's go")
        check(poll1(conn, select.POLLIN, 0), "the unread bytes are there")
        read = b""
        try:
            socket.send_fds(ours, [PASS_HEADER.pack(b"fd", 0)], [conn.fileno()])
        except OSError as e:
            # Under the preload, when the bytes it never read cannot be carried through the
            # ring (no room): the fd must not go yet. Read them, hand them on, pass again.
            if e.errno != errno.EBUSY:
                raise
            log(f"NOTE server {args.case}: SCM_RIGHTS refused with EBUSY; reading the tail")
            read = recv_exact(conn, TAIL_BYTES, "the unread bytes")
            socket.send_fds(ours, [PASS_HEADER.pack(b"fd", len(read))], [conn.fileno()])
        ours.sendall(read)
        conn.close()


def tail_worker(case, fd):
    unix = socket.socket(fileno=fd)
    unix.settimeout(25)
    unix.sendall(b"ready\n")
    msg, fds, _, _ = socket.recv_fds(unix, PASS_HEADER.size, 1)
    eq(len(fds), 1, "the passed connection")
    tag, n = PASS_HEADER.unpack(msg)
    eq(tag, b"fd", "the pass message")
    got = bytearray(recv_exact(unix, n, "what the dispatcher read itself") if n else b"")
    conn = socket.socket(fileno=fds[0])
    conn.settimeout(20)
    want = b"".join(tail_stream(case))
    eq(bytes(got), want[:n], "what the dispatcher read itself")
    while True:
        b = conn.recv(CHUNK)
        if not b:
            break
        end = len(got) + len(b)
        if b != want[len(got) : end]:
            at = next(i for i in range(len(b)) if end > len(want) or b[i] != want[len(got) + i])
            raise Fail(f"wrong byte at offset {len(got) + at} of {len(want)} (tail "
                       f"{TAIL_BYTES}, then ring {RING_BYTES[case]}): got "
                       f"{b[at : at + 8].hex()}, want {want[len(got) + at : len(got) + at + 8].hex()}")
        got += b
    eq(len(got), len(want), "bytes received (tail, ring bytes, the rest), then EOF")
    conn.sendall(f"got {len(got)} {sha(got)}\n".encode())
    conn.close()
    unix.sendall(b"ok\n")
    unix.close()


def tail_client(args):
    s = dial(args)
    s.settimeout(30)
    s.sendall(HELLO)
    eq(recv_exact(s, len(ACCEPTED), "accepted"), ACCEPTED, "the dispatcher's answer")
    tail, ring, rest = tail_stream(args.case)
    operator("demote")  # both sides on TCP
    s.sendall(tail)  # on TCP: the dispatcher never reads it
    operator("promote")  # back on the ring; the dispatcher's side with `tail` still unread
    on_ring = threading.Event()

    def send():
        s.sendall(ring)  # on the ring (on kernel TCP it may wait for the worker's reads)
        on_ring.set()
        for i in range(0, REST_BYTES, CHUNK):  # while the fd changes hands, and after
            s.sendall(rest[i : i + CHUNK])
            time.sleep(0.002)
        s.shutdown(socket.SHUT_WR)

    join = with_thread(send)
    on_ring.wait(2.0)
    if args.case == "unread_tail_operator":
        operator("demote")  # the dispatcher's side, in none of its calls, must carry its tail
    with open(args.port_file + ".pass", "w"):
        pass
    want = tail + ring + rest
    line = recv_exact(s, len(f"got {len(want)} {sha(b'')}\n"), "the worker's verdict")
    eq(line.decode().split(), ["got", str(len(want)), sha(want)], "what the worker read")
    t0 = now()
    eq(s.recv(10), b"", "EOF after the verdict")
    check(now() - t0 <= EOF_WITHIN, "EOF promptly after the verdict")
    join()
    s.close()


# ---- pidfd_getfd: a third process takes the client's socket ----------------------------------------

SYS_PIDFD_GETFD = 438
_LIBC.syscall.restype = ctypes.c_long
_LIBC.syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long]
_LIBC.pidfd_getfd.restype = ctypes.c_int
_LIBC.pidfd_getfd.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint]
# Chunks of the stream, by number: odd ones are the grabber's turns while both hold it.
PIDFD_CHUNKS = 48
PIDFD_SHARED_TURNS = 24
# The chunk the client leaves unread in its rx ring while the grabber takes the socket.
PIDFD_INFLIGHT = 256 << 10
# Pause after each chunk: ~2 s for a whole stream (the promoter asks every 50 ms).
PIDFD_PACE = 2.0 / PIDFD_CHUNKS


def pidfd_chunk(i):
    size = PIDFD_INFLIGHT if i == 0 else 1 + (i * 7919) % (96 << 10)
    return pattern(size, 1200 + i)


def pidfd_stream():
    return b"".join(pidfd_chunk(i) for i in range(PIDFD_CHUNKS))


def pidfd_turn(sock, i, who):
    """Chunk i: sent (from a thread: the server echoes while we send), its echo read and
    checked."""
    data = pidfd_chunk(i)
    join = with_thread(sock.sendall, data)
    eq(recv_exact(sock, len(data), f"the echo of chunk {i} ({who})"), data,
       f"the echo of chunk {i} ({who})")
    join()


def try_pidfd_getfd(pid, fd, wrapper=False):
    """pidfd_getfd by its system call (as Python must), or by the C library's wrapper (glibc
    2.36, as a C program calls it): the new fd, or -errno."""
    pidfd = os.pidfd_open(pid)
    try:
        if wrapper:
            r = _LIBC.pidfd_getfd(pidfd, fd, 0)
        else:
            r = _LIBC.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        return r if r >= 0 else -ctypes.get_errno()
    finally:
        os.close(pidfd)


def pidfd_getfd(pid, fd, wrapper=False):
    r = try_pidfd_getfd(pid, fd, wrapper)
    if r < 0:
        raise Fail(f"pidfd_getfd({pid}, {fd}) failed: {os.strerror(-r)} (errno {-r})")
    return r


def proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def grab_from_stopped(pid, fd):
    """The client is stopped (SIGSTOP) when the grabber takes its ring connection: under the
    preload it cannot leave its ring, so the call fails with EAGAIN within
    MEMLOOP_PIDFD_WAIT_US (the grabber runs with 0.3 s) and the demote stays asked; once the
    client runs again a new call succeeds. On kernel TCP the first call succeeds."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: proc_state(pid) == "T", 5, "the client stopped")
        t0 = now()
        r = try_pidfd_getfd(pid, fd)
        if preloaded():
            eq(r, -errno.EAGAIN, "pidfd_getfd of a stopped holder's ring connection")
            check(now() - t0 < 5, f"EAGAIN after {now() - t0:.2f} s (MEMLOOP_PIDFD_WAIT_US)")
        else:
            check(r >= 0, f"pidfd_getfd of a stopped process's socket: errno {-r}")
            return r
    finally:
        os.kill(pid, signal.SIGCONT)
    got = []

    def again():
        r = try_pidfd_getfd(pid, fd)
        check(r >= 0 or r == -errno.EAGAIN, f"pidfd_getfd after SIGCONT: errno {-r}")
        if r >= 0:
            got.append(r)
        return r >= 0

    wait_until(again, 10, "pidfd_getfd to succeed once the client runs again", step=0.05)
    return got[0]


# ---- slot_reuse --------------------------------------------------------------------------------

def slot_reuse_server(lsock, args):
    """Echoes the client's two connections, one after the other, each until EOF."""
    for _ in range(2):
        conn, _ = lsock.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def echo_rounds(sock, n, tag):
    for i in range(n):
        msg = f"{tag}-{i}".encode().ljust(64, b".")
        sock.sendall(msg)
        eq(recv_exact(sock, len(msg)), msg, f"echo {tag} {i}")


def slot_reuse_client(args):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c1 = dial(args)
    echo_rounds(c1, 10, "c1")
    socket.send_fds(ours, [b"fd"], [c1.fileno()])
    _, fds, _, _ = socket.recv_fds(theirs, 16, 1)
    os.close(fds[0])
    c1.close()
    time.sleep(2.0)  # both ends closed C1: its channel slot is free for C2
    c2 = dial(args)
    echo_rounds(c2, 10, "c2")
    socket.send_fds(ours, [b"fd"], [c2.fileno()])
    # C1's hold record expires ~10 s after its pass, C2's ~10 s after its own, 2 s later:
    # claim C2 in between.
    time.sleep(9.0)
    _, fds, _, _ = socket.recv_fds(theirs, 16, 1)
    c2.close()
    s = socket.socket(fileno=fds[0])
    promoter = start_promoter()
    try:
        end = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < end:
            echo_rounds(s, 1, f"c2-{i}")
            i += 1
            time.sleep(0.01)
    finally:
        stop_promoter(promoter)
    echo_rounds(s, 100, "after")
    s.close()


def pidfd_failed_counted():
    """`memloop status --json`'s refused pidfd_getfd calls (None on kernel TCP)."""
    bin_ = os.environ.get("MEMLOOP_BIN")
    if not bin_ or not os.environ.get("MEMLOOP_REGION") or not preloaded():
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MEMLOOP_LOG")}
    out = subprocess.run([bin_, "status", "--json"], env=env, capture_output=True, check=True)
    return json.loads(out.stdout)["pidfd_failed"]


def pidfd_finish(sock, who):
    """Shut down our side: the server's sha256 of the whole stream, then EOF promptly."""
    sock.shutdown(socket.SHUT_WR)
    got = recv_exact(sock, 64, f"the server's sha256 ({who})")
    t_last = now()
    eq(sock.recv(100), b"", f"EOF after the sha256 ({who})")
    check(now() - t_last <= EOF_WITHIN, f"EOF promptly after the sha256 ({who})")
    eq(got.decode(), sha(pidfd_stream()), f"the server's sha256 of the whole stream ({who})")


def pidfd_serve(lsock, args):
    conn, _ = lsock.accept()
    lsock.close()
    conn.settimeout(30)
    echo_with_sha(conn, CHUNK)
    conn.close()


def start_promoter():
    """A process of its own, without the library (forking the client for every command would
    mark its connection shared each time), that asks `memloop promote --all` every 50 ms until
    its stdin closes; None on kernel TCP (no MEMLOOP_BIN or region)."""
    if not os.environ.get("MEMLOOP_BIN") or not os.environ.get("MEMLOOP_REGION"):
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MEMLOOP_LOG")}
    return subprocess.Popen(helper_argv("pidfd-promoter", "-"), env=env, stdin=subprocess.PIPE)


def stop_promoter(p):
    if p:
        p.stdin.close()
        eq(wait_popen(p, "the promoter"), 0, "the promoter's exit code")


def pidfd_promoter():
    bin_ = os.environ["MEMLOOP_BIN"]
    while not select.select([sys.stdin], [], [], 0.05)[0]:
        subprocess.run([bin_, "promote", "--all", "--wait", "0"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def pidfd_client(args):
    # Promotions are asked all along: none may happen while the client (unaware of the
    # grabber) and the grabber both hold the connection; once one holds it alone it may.
    promoter = start_promoter()
    try:
        pidfd_client_with(args)
    finally:
        stop_promoter(promoter)


def pidfd_client_with(args):
    s = dial(args)
    s.settimeout(30)
    ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.settimeout(30)
    lines = Lines(ctl)
    # A pipe the grabber takes too (anything else passes through untouched).
    pipe_r, pipe_w = os.pipe()
    env = dict(os.environ)
    if args.case == "pidfd_owner_stopped":
        env["MEMLOOP_PIDFD_WAIT_US"] = "300000"
    grabber = subprocess.Popen(
        helper_argv("pidfd-grabber", args.case, os.getpid(), s.fileno(), theirs.fileno(),
                    pipe_w),
        pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    try:
        # Chunk 0 echoed into our rx ring and left there while the grabber takes the socket.
        s.sendall(pidfd_chunk(0))
        wait_until(lambda: poll1(s, select.POLLIN, 0), 10, "the echo of chunk 0")
        time.sleep(0.1)
        eq(lines.line(), "ready", "the grabber is up")
        cmd(ctl, "grab")
        eq(lines.line(), "grabbed", "the grabber took the socket")
        os.close(pipe_w)
        eq(os.read(pipe_r, 100), b"through the pipe\n", "what the grabber wrote on our pipe")
        eq(os.read(pipe_r, 100), b"", "EOF on our pipe (the grabber closed its copy)")
        os.close(pipe_r)
        eq(recv_exact(s, PIDFD_INFLIGHT, "the echo of chunk 0"), pidfd_chunk(0),
           "the echo of chunk 0, unread while the socket was taken")
        shared = args.case in ("pidfd_shared", "pidfd_owner_stopped")
        last = PIDFD_CHUNKS if shared else PIDFD_SHARED_TURNS
        for i in range(1, last):
            if i % 2 == 0:
                pidfd_turn(s, i, "client")
            else:
                cmd(ctl, f"turn {i}")
                eq(lines.line(), f"done {i}", f"the grabber's turn {i}")
            time.sleep(PIDFD_PACE)  # (paced: promotions are asked meanwhile)
        if shared:
            pidfd_finish(s, "client")
            cmd(ctl, "eof")
            eq(lines.line(), "eof", "the grabber read EOF too")
        elif args.case == "pidfd_owner_closes":
            s.close()
            cmd(ctl, "alone")
            eq(lines.line(), "finished", "the grabber finished alone")
        else:
            cmd(ctl, "close")
            eq(lines.line(), "closed", "the grabber closed its copy")
            for i in range(last, PIDFD_CHUNKS):
                pidfd_turn(s, i, "client alone")
                time.sleep(PIDFD_PACE)
            pidfd_finish(s, "client")
        cmd(ctl, "bye")
    finally:
        code = wait_popen(grabber, "the grabber")
    eq(code, 0, "the grabber's exit code")


def pidfd_grabber(case, pid, fd, ctl_fd, pipe_fd):
    ctl = socket.socket(fileno=ctl_fd)
    ctl.settimeout(30)
    lines = Lines(ctl)
    cmd(ctl, "ready")
    eq(lines.line(), "grab", "the client's go")
    if case == "pidfd_owner_stopped":
        sock = socket.socket(fileno=grab_from_stopped(pid, fd))
        n = pidfd_failed_counted()
        check(n is None or n >= 1, f"refused pidfd_getfd calls counted: {n}")
    else:
        # (The wrapper in one case, the system call in the others.)
        wrapper = case == "pidfd_owner_closes"
        sock = socket.socket(fileno=pidfd_getfd(pid, fd, wrapper=wrapper))
    sock.settimeout(30)
    check(sock.getpeername(), "the grabbed socket is connected")
    pipe = pidfd_getfd(pid, pipe_fd)
    eq(os.write(pipe, b"through the pipe\n"), 17, "a write on the client's pipe")
    os.close(pipe)
    cmd(ctl, "grabbed")
    while True:
        ln = lines.line()
        if ln is None or ln == "bye":
            break
        w = ln.split()
        if w[0] == "turn":
            pidfd_turn(sock, int(w[1]), "grabber")
            cmd(ctl, f"done {w[1]}")
        elif w[0] == "eof":
            t0 = now()
            eq(sock.recv(100), b"", "EOF in the grabber")
            check(now() - t0 <= EOF_WITHIN, "EOF promptly in the grabber")
            sock.close()
            cmd(ctl, "eof")
        elif w[0] == "alone":
            for i in range(PIDFD_SHARED_TURNS, PIDFD_CHUNKS):
                pidfd_turn(sock, i, "grabber alone")
                time.sleep(PIDFD_PACE)
            pidfd_finish(sock, "grabber")
            sock.close()
            cmd(ctl, "finished")
        elif w[0] == "close":
            sock.close()
            cmd(ctl, "closed")
        else:
            raise Fail(f"unknown command {ln!r}")
    ctl.close()


CASES = {
    "inetd_chain": (inetd_server, inetd_client),
    "inetd_exit_no_close": (inetd_server, inetd_client),
    "scm_rights_preloaded": (scm_server, scm_client),
    "scm_rights_plain_worker": (scm_server, scm_client),
    "scm_rights_back_to_ring": (scm_server, scm_client),
    "scm_rights_mmsg": (scm_server, scm_client),
    "reexec_privsep": (privsep_server, privsep_client),
    "exec_back_to_ring": (exec_server, exec_client),
    "exec_through_plain": (exec_server, exec_client),
    "oob": (oob_serve, oob_client),
    "slot_reuse": (slot_reuse_server, slot_reuse_client),
    "unread_tail": (tail_server, tail_client),
    "unread_tail_no_room": (tail_server, tail_client),
    "unread_tail_operator": (tail_server, tail_client),
    "pidfd_shared": (pidfd_serve, pidfd_client),
    "pidfd_owner_closes": (pidfd_serve, pidfd_client),
    "pidfd_grabber_closes": (pidfd_serve, pidfd_client),
    "pidfd_owner_stopped": (pidfd_serve, pidfd_client),
}

HELPERS = {
    "inetd-handler": lambda a: inetd_handler(a[0]),
    "inetd-echo": lambda a: inetd_echo(a[0]),
    "scm-worker": lambda a: scm_worker(a[0], int(a[1])),
    "privsep": lambda a: privsep_child(a[0], int(a[1]), a[2]),
    "exec-serve": lambda a: exec_serve(a[0], int(a[1])),
    "tail-worker": lambda a: tail_worker(a[0], int(a[1])),
    "pidfd-grabber": lambda a: pidfd_grabber(a[0], *map(int, a[1:5])),
    "pidfd-promoter": lambda a: pidfd_promoter(),
}


def helper_main(role, rest):
    """A helper image: its own watchdog; failures go to stderr (fd 1 may be the connection);
    the verdict is the exit code, which the server role checks."""
    import traceback  # now: after a chroot nothing can be imported

    faulthandler.dump_traceback_later(HELPER_DEADLINE, exit=True)
    case = rest[0]
    try:
        HELPERS[role](rest)
    except Fail as e:
        print(f"FAIL server {case} ({role}): {e}", file=sys.stderr, flush=True)
        os._exit(1)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"FAIL server {case} ({role}): {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in HELPERS:
        helper_main(sys.argv[1], sys.argv[2:])
    run(CASES)
