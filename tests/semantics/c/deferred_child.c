/* A fork-per-connection server's child runs none of the engine until it needs it, and works
 * both before and after (run under the preload with MEMLOOP_LOG=debug; the test reads the log).
 *
 * The server listens on 127.0.0.1 and prints its port; the test (not preloaded: a client
 * without the library) connects, sends "ping" lines and reads them back. The child forked for
 * the connection:
 *   1. checks that its copy of the engine's lock fd is gone (the engine's fd at 64 or above
 *      on the region file: a child holding it would keep its parent "alive");
 *   2. closes the listener, echoes the client's lines (plain TCP, without the engine),
 *      waiting for each in poll(), then closes every fd from 100 up (closefrom: the
 *      engine's lock fd is among them, already closed);
 *   3. forks a grandchild, which needs the engine first (a new inet socket to the server's
 *      second listener, a member: a ring) and exchanges over it;
 *   4. then needs the engine itself the same way, and exits.
 * Prints "child ok" / "grandchild ok" lines (or what failed) on stdout. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static int listen_on(struct sockaddr_in *a) {
    socklen_t len = sizeof *a;
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a->sin_port = 0;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0 || bind(l, (void *)a, len) || listen(l, 8) || getsockname(l, (void *)a, &len)) {
        perror("listen");
        exit(1);
    }
    return l;
}

/* fds at 64 or above that name the region file (the engine's lock is one). */
static int region_fds_up_high(const char *region) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int fd = atoi(e->d_name);
        char path[64], link[512];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        ssize_t k = readlink(path, link, sizeof link - 1);
        if (fd >= 64 && k > 0) {
            link[k] = 0;
            n += strcmp(link, region) == 0;
        }
    }
    if (d) {
        closedir(d);
    }
    return n;
}

/* A new inet socket to the second listener (a member): one exchange. */
static int ring_exchange(struct sockaddr_in *to, const char *who) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    char b[8] = {0};
    if (s < 0 || connect(s, (void *)to, sizeof *to) || write(s, who, 4) != 4 ||
        read(s, b, 4) != 4 || memcmp(b, who, 4) != 0) {
        printf("%s: exchange with the second listener failed: %s\n", who, strerror(errno));
        return 1;
    }
    close(s);
    return 0;
}

int main(int argc, char **argv) {
    const char *region = argc > 1 ? argv[1] : "";
    struct sockaddr_in a, b;
    int l = listen_on(&a), l2 = listen_on(&b);
    printf("port %d\n", ntohs(a.sin_port));
    fflush(stdout);
    int held = region_fds_up_high(region);
    int c = accept(l, NULL, NULL);
    if (c < 0) {
        perror("accept");
        return 1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        int mine = region_fds_up_high(region);
        close(l);
        char buf[64];
        ssize_t n;
        int bytes = 0;
        struct pollfd p = {.fd = c, .events = POLLIN};
        while (poll(&p, 1, 10000) == 1 && (n = read(c, buf, sizeof buf)) > 0) {
            if (write(c, buf, (size_t)n) != n) {
                break;
            }
            bytes += (int)n;
        }
        close(c);
        closefrom(100);
        pid_t g = fork();
        if (g == 0) {
            _exit(ring_exchange(&b, "gran") ? 1 : (printf("grandchild ok\n"), fflush(stdout), 0));
        }
        int st = 0;
        waitpid(g, &st, 0);
        int bad = ring_exchange(&b, "chil");
        printf("child ok: lock fds %d in the parent, %d here; %d bytes echoed; grandchild %s\n",
               held, mine, bytes, WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "ok" : "failed");
        fflush(stdout);
        exit(bad);
    }
    close(c);
    /* Serve the second listener (the grandchild's and the child's exchanges), then reap. */
    for (int i = 0; i < 2; i++) {
        int s = accept(l2, NULL, NULL);
        char x[4];
        if (s < 0 || read(s, x, 4) != 4 || write(s, x, 4) != 4) {
            printf("server: the second listener's exchange failed\n");
        }
        close(s);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}
