/* The side that closes first keeps TIME_WAIT, as on TCP.
 *
 * A client thread connects, sends, and closes; the server thread reads to EOF and closes at
 * once (a blocking recv spins on a ring, so it sees the client's EOF within nanoseconds, well
 * before the client's real close). On TCP the client's FIN always goes first; if the server's
 * went first, TIME_WAIT would hold the server's listening port, and a restarted server without
 * SO_REUSEADDR could not bind it. Prints what it found; exit 0 if no TIME_WAIT is on the
 * server's port. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define ROUNDS 50

static int port;

static void *client(void *arg) {
    (void)arg;
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
    return NULL;
}

/* TIME_WAIT sockets (state 06) whose local port is ours. */
static int time_waits(void) {
    FILE *f = fopen("/proc/net/tcp", "r");
    char line[512];
    int n = 0;
    if (!f || !fgets(line, sizeof line, f)) {
        perror("/proc/net/tcp");
        exit(2);
    }
    while (fgets(line, sizeof line, f)) {
        unsigned lport, state;
        if (sscanf(line, " %*d: %*x:%x %*x:%*x %x", &lport, &state) == 2 && state == 6 &&
            (int)lport == port)
            n++;
    }
    fclose(f);
    return n;
}

int main(void) {
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
    pthread_t t;
    pthread_create(&t, NULL, client, NULL);
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
    }
    pthread_join(t, NULL);
    close(l);
    usleep(100000);
    int n = time_waits();
    printf("%d of %d connections left TIME_WAIT on the server's port\n", n, ROUNDS);
    return n == 0 ? 0 : 1;
}
