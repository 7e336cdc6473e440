/* The side that closes first keeps TIME_WAIT, as on TCP.
 *
 * A client process connects, sends, and closes; the server thread reads to EOF and closes at
 * once (a blocking recv spins on a ring, so it sees the client's EOF within nanoseconds, well
 * before the client's real close). On TCP the client's FIN always goes first; if the server's
 * went first, TIME_WAIT would hold the server's listening port, and a restarted server without
 * SO_REUSEADDR could not bind it. Prints what it found; exit 0 if no TIME_WAIT is on the
 * server's port.
 *
 * With `fork`, the server forks a child after each close that lives on for a second: the child
 * must not keep the closed connection open (no FIN would go until it exits), so no client
 * socket may still wait in FIN_WAIT2 for the server's FIN. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROUNDS 50

static int port;

static void client(void) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < ROUNDS; i++) {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
            perror("connect");
            exit(2);
        }
        if (send(s, "request", 7, 0) != 7) {
            perror("send");
            exit(2);
        }
        close(s);
    }
}

/* Sockets in `want` state whose local (or, `remote`, remote) port is ours. */
static int in_state(unsigned want, int remote) {
    FILE *f = fopen("/proc/net/tcp", "r");
    char line[512];
    int n = 0;
    if (!f || !fgets(line, sizeof line, f)) {
        perror("/proc/net/tcp");
        exit(2);
    }
    while (fgets(line, sizeof line, f)) {
        unsigned lport, rport, state;
        if (sscanf(line, " %*d: %*x:%x %*x:%x %x", &lport, &rport, &state) == 3 &&
            state == want && (int)(remote ? rport : lport) == port)
            n++;
    }
    fclose(f);
    return n;
}

int main(int argc, char **argv) {
    int forking = argc > 1 && strcmp(argv[1], "fork") == 0;
    pid_t kids[ROUNDS];
    int nkids = 0;
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t alen = sizeof a;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 64) ||
        getsockname(l, (struct sockaddr *)&a, &alen)) {
        perror("listen");
        return 2;
    }
    port = ntohs(a.sin_port);
    pid_t cl = fork();
    if (cl == 0) {
        close(l);
        client();
        _exit(0);
    }
    for (int i = 0; i < ROUNDS; i++) {
        int c = accept(l, NULL, NULL);
        char buf[64];
        ssize_t r;
        while ((r = recv(c, buf, sizeof buf, 0)) > 0) {
        }
        if (r < 0) {
            perror("recv");
            return 2;
        }
        close(c);
        if (forking) {
            pid_t k = fork();
            if (k == 0) {
                sleep(1);
                _exit(0);
            }
            kids[nkids++] = k;
        }
    }
    int st;
    if (waitpid(cl, &st, 0) != cl || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "the client failed\n");
        return 2;
    }
    close(l);
    usleep(300000);
    int n = in_state(6, 0), waiting = in_state(5, 1);
    printf("%d of %d connections left TIME_WAIT on the server's port, %d client sockets wait "
           "in FIN_WAIT2\n",
           n, ROUNDS, waiting);
    for (int i = 0; i < nkids; i++) {
        kill(kids[i], SIGKILL);
        waitpid(kids[i], NULL, 0);
    }
    return n == 0 && waiting == 0 ? 0 : 1;
}
