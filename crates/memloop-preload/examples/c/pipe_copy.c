/*
 * pipe_copy: the pipe service's C API (include/memloop_pipe.h), run under `memloop run` with
 * a `memloop pipe serve` listening (crates/memloop-preload/tests/pipe.rs builds and runs it).
 *
 *     pipe_copy FILE OUTDIR
 *
 * 1. memloop_pipe, blocking: FILE -> a Unix socket and FILE -> a TCP connection over loopback
 *    (under `memloop run` likely a ring connection, which leaves its ring first), each read by
 *    a thread that checksums what arrives;
 * 2. memloop_pipe_submit, two transfers at once: FILE -> a pipe (read by a thread) and
 *    FILE -> OUTDIR/copy (a file); their completions taken by polling memloop_pipe_fd and
 *    calling memloop_pipe_complete without waiting;
 * 3. a transfer from a pipe nobody writes, cancelled: its completion's error is ECANCELED
 *    (told apart from "none yet", -EAGAIN);
 * 4. the edges: a closed descriptor is -EBADF, nothing in flight is -ENOENT;
 * 5. fork: the child's memloop_pipe goes through a connection of its own (the parent's is
 *    never used there), and the parent's still works after.
 *
 * Prints "ok ..." and exits 0; says what failed and exits 1; exits 2 when the functions are
 * not there (not under `memloop run`).
 */
#define _GNU_SOURCE
#include "../../include/memloop_pipe.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int failed;

#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "pipe_copy: FAILED %s:%d: ", __FILE__, __LINE__);                 \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fputc('\n', stderr);                                                              \
            failed = 1;                                                                       \
        }                                                                                     \
    } while (0)

#define DIE(...)                                                                              \
    do {                                                                                      \
        fprintf(stderr, "pipe_copy: " __VA_ARGS__);                                           \
        fputc('\n', stderr);                                                                  \
        exit(1);                                                                              \
    } while (0)

/* FNV-1a, 64 bits: order-sensitive. */
struct sum {
    uint64_t h, n;
};

static void sum_init(struct sum *s) {
    s->h = 0xcbf29ce484222325ULL;
    s->n = 0;
}

static void sum_add(struct sum *s, const unsigned char *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        s->h = (s->h ^ b[i]) * 0x100000001b3ULL;
    }
    s->n += n;
}

static struct sum sum_fd(int fd) {
    struct sum s;
    sum_init(&s);
    static unsigned char buf[1 << 16];
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            if (r < 0) {
                fprintf(stderr, "pipe_copy: read: %s\n", strerror(errno));
                s.n = UINT64_MAX;
            }
            return s;
        }
        sum_add(&s, buf, (size_t)r);
    }
}

/* A thread reading `fd` to its end. */
struct drain {
    pthread_t t;
    int fd;
    struct sum got;
};

static void *drain_main(void *arg) {
    struct drain *d = arg;
    d->got = sum_fd(d->fd);
    return NULL;
}

static void drain_start(struct drain *d, int fd) {
    d->fd = fd;
    if (pthread_create(&d->t, NULL, drain_main, d) != 0) {
        DIE("pthread_create");
    }
}

static struct sum drain_end(struct drain *d) {
    pthread_join(d->t, NULL);
    close(d->fd);
    return d->got;
}

static int open_or_die(const char *path, int flags) {
    int fd = open(path, flags | O_CLOEXEC, 0600);
    if (fd < 0) {
        DIE("open %s: %s", path, strerror(errno));
    }
    return fd;
}

/* memloop_pipe of the whole file into a fresh Unix socket, read by a thread: 1 if every byte
 * arrived. */
static int whole_file_to_a_socket(const char *file, struct sum want, const char *who) {
    int us[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, us) != 0) {
        DIE("socketpair: %s", strerror(errno));
    }
    struct drain d;
    drain_start(&d, us[1]);
    int f = open_or_die(file, O_RDONLY);
    int64_t n = memloop_pipe(f, us[0], 0);
    close(f);
    close(us[0]);
    struct sum got = drain_end(&d);
    CHECK(n == (int64_t)want.n && got.n == want.n && got.h == want.h,
          "%s: memloop_pipe = %" PRId64 ", %" PRIu64 " bytes arrived", who, n, got.n);
    return n == (int64_t)want.n && got.n == want.n && got.h == want.h;
}

/* A TCP connection over loopback: (*client, *server). */
static void tcp_pair(int *client, int *server) {
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) != 0 || listen(l, 1) != 0 ||
        getsockname(l, (struct sockaddr *)&a, &len) != 0) {
        DIE("listen: %s", strerror(errno));
    }
    *client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (*client < 0 || connect(*client, (struct sockaddr *)&a, sizeof a) != 0) {
        DIE("connect: %s", strerror(errno));
    }
    *server = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    if (*server < 0) {
        DIE("accept: %s", strerror(errno));
    }
    close(l);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: pipe_copy FILE OUTDIR\n");
        return 1;
    }
    if (!memloop_pipe_available()) {
        fprintf(stderr, "pipe_copy: memloop_pipe is not there (run it under `memloop run`)\n");
        return 2;
    }
    const char *file = argv[1];
    int f = open_or_die(file, O_RDONLY);
    struct sum want = sum_fd(f);
    close(f);
    CHECK(want.n > 0 && want.n != UINT64_MAX, "empty or unreadable %s", file);

    /* 1. Blocking: file -> Unix socket, file -> TCP. */
    int us[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, us) != 0) {
        DIE("socketpair: %s", strerror(errno));
    }
    int tcp_client, tcp_server;
    tcp_pair(&tcp_client, &tcp_server);
    struct {
        const char *what;
        int out, in;
    } blocking[] = {{"unix", us[0], us[1]}, {"tcp", tcp_client, tcp_server}};
    for (size_t i = 0; i < sizeof blocking / sizeof blocking[0]; i++) {
        struct drain d;
        drain_start(&d, blocking[i].in);
        f = open_or_die(file, O_RDONLY);
        int64_t n = memloop_pipe(f, blocking[i].out, 0);
        CHECK(n == (int64_t)want.n, "memloop_pipe(file -> %s) = %" PRId64 " (%s), want %" PRIu64,
              blocking[i].what, n, n < 0 ? strerror((int)-n) : "", want.n);
        CHECK(lseek(f, 0, SEEK_CUR) == (off_t)want.n, "file -> %s: the file position is %lld",
              blocking[i].what, (long long)lseek(f, 0, SEEK_CUR));
        close(f);
        shutdown(blocking[i].out, SHUT_WR);
        struct sum got = drain_end(&d);
        close(blocking[i].out);
        CHECK(got.n == want.n && got.h == want.h,
              "file -> %s: %" PRIu64 " bytes arrived (hash %016" PRIx64 "), want %" PRIu64
              " (%016" PRIx64 ")",
              blocking[i].what, got.n, got.h, want.n, want.h);
    }

    /* 2. Two at once: file -> pipe, file -> file; completions through memloop_pipe_fd. */
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        DIE("pipe: %s", strerror(errno));
    }
    struct drain pd;
    drain_start(&pd, p[0]);
    char copy[4096];
    snprintf(copy, sizeof copy, "%s/copy", argv[2]);
    int f1 = open_or_die(file, O_RDONLY), f2 = open_or_die(file, O_RDONLY);
    int out = open_or_die(copy, O_WRONLY | O_CREAT | O_TRUNC);
    int64_t to_pipe = memloop_pipe_submit(f1, p[1], 0);
    int64_t to_file = memloop_pipe_submit(f2, out, want.n);
    CHECK(to_pipe > 0 && to_file > 0 && to_pipe != to_file, "submit: ids %" PRId64 ", %" PRId64,
          to_pipe, to_file);
    /* The service holds its own references: ours may go now (the pipe's write end must, or
     * the reader would never see its end). */
    close(f1);
    close(f2);
    close(p[1]);
    int nfd = memloop_pipe_fd();
    CHECK(nfd >= 0, "memloop_pipe_fd = %d", nfd);
    int done = 0, pipe_done = 0, file_done = 0, polls = 0, again = 0;
    while (done < 2 && nfd >= 0 && polls < 1000) {
        struct pollfd pfd = {.fd = nfd, .events = POLLIN};
        int r = poll(&pfd, 1, 10000);
        polls++;
        CHECK(r == 1, "poll(memloop_pipe_fd) = %d (%s): no completion in 10 s", r,
              r < 0 ? strerror(errno) : "timeout");
        if (r != 1) {
            break;
        }
        while (done < 2) {
            int64_t id = 0;
            uint64_t moved = 0;
            int error = -1;
            int c = memloop_pipe_complete(&id, &moved, &error, 0);
            if (c == -EAGAIN) {
                again++;
                break;
            }
            CHECK(c == 0, "memloop_pipe_complete = %d (%s)", c, strerror(-c));
            if (c != 0) {
                done = 2;
                break;
            }
            CHECK(error == 0, "transfer %" PRId64 " failed: %s", id, strerror(error));
            CHECK(moved == want.n, "transfer %" PRId64 " moved %" PRIu64, id, moved);
            pipe_done += id == to_pipe;
            file_done += id == to_file;
            done++;
        }
    }
    CHECK(pipe_done == 1 && file_done == 1, "completions: pipe %d, file %d", pipe_done,
          file_done);
    struct sum got = drain_end(&pd);
    CHECK(got.n == want.n && got.h == want.h, "file -> pipe: %" PRIu64 " bytes arrived",
          got.n);
    close(out);
    out = open_or_die(copy, O_RDONLY);
    got = sum_fd(out);
    close(out);
    CHECK(got.n == want.n && got.h == want.h, "file -> file: %" PRIu64 " bytes in the copy",
          got.n);

    /* 3. Cancelled: its own error (ECANCELED) is not "none yet" (-EAGAIN). */
    int q[2];
    if (pipe2(q, O_CLOEXEC) != 0) {
        DIE("pipe: %s", strerror(errno));
    }
    int sink = open_or_die("/dev/null", O_WRONLY);
    int64_t stuck = memloop_pipe_submit(q[0], sink, 0);
    CHECK(stuck > 0, "submit (a pipe nobody writes) = %" PRId64, stuck);
    int64_t id = 0;
    uint64_t moved = 1;
    int error = 0;
    int c = memloop_pipe_complete(&id, &moved, &error, 0);
    CHECK(c == -EAGAIN, "complete before the cancel = %d, want -EAGAIN", c);
    c = memloop_pipe_cancel(stuck);
    CHECK(c == 0, "memloop_pipe_cancel = %d (%s)", c, strerror(-c));
    c = memloop_pipe_complete(&id, &moved, &error, 1);
    CHECK(c == 0 && id == stuck && error == ECANCELED && moved == 0,
          "the cancelled one: %d, id %" PRId64 ", error %d (%s), moved %" PRIu64, c, id, error,
          strerror(error), moved);
    close(q[0]);
    close(q[1]);
    close(sink);

    /* 4. Edges. */
    c = memloop_pipe_complete(&id, &moved, &error, 1);
    CHECK(c == -ENOENT, "complete with nothing in flight = %d, want -ENOENT", c);
    c = memloop_pipe_cancel(stuck);
    CHECK(c == -ENOENT, "cancel of a finished transfer = %d, want -ENOENT", c);
    int64_t n = memloop_pipe(1000000, 1, 0);
    CHECK(n == -EBADF, "memloop_pipe(a closed fd) = %" PRId64 ", want -EBADF", n);
    CHECK(memloop_pipe_fd() == nfd, "memloop_pipe_fd changed");

    /* 5. Fork. */
    fflush(NULL);
    pid_t child = fork();
    if (child < 0) {
        DIE("fork: %s", strerror(errno));
    }
    if (child == 0) {
        _exit(whole_file_to_a_socket(file, want, "fork child") && !failed ? 0 : 1);
    }
    int st = 0;
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0,
          "the fork child failed (status %#x)", st);
    whole_file_to_a_socket(file, want, "parent after the fork");

    if (failed) {
        return 1;
    }
    printf("ok bytes=%" PRIu64 " blocking=2 concurrent=2 polls=%d again=%d cancelled=ECANCELED "
           "fork=ok\n",
           want.n, polls, again);
    return 0;
}
