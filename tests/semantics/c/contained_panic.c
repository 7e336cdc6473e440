/* A panic inside the engine, in a C program (which has no unwinder of its own loaded), is
 * contained: the call fails with EIO and the program goes on. Run with
 * MEMLOOP_TEST_PANIC=connect:1 under the preload. The engine loads libgcc_s only to unwind:
 * it is absent before the panic and present after. Prints one line: what it saw. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int mapped(const char *name) {
    char line[512];
    int found = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    while (f && !found && fgets(line, sizeof line, f)) {
        found = strstr(line, name) != NULL;
    }
    if (f) {
        fclose(f);
    }
    return found;
}

int main(void) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0 || bind(l, (void *)&a, len) || listen(l, 4) || getsockname(l, (void *)&a, &len)) {
        printf("setup failed: %s\n", strerror(errno));
        return 1;
    }
    int before = mapped("libgcc_s");
    int c1 = socket(AF_INET, SOCK_STREAM, 0);
    int r = connect(c1, (void *)&a, len);
    int err = errno;
    int after = mapped("libgcc_s");
    close(c1);
    int c2 = socket(AF_INET, SOCK_STREAM, 0);
    char b = 'x';
    int ok = connect(c2, (void *)&a, len) == 0;
    int s = ok ? accept(l, NULL, NULL) : -1;
    ok = ok && s >= 0 && write(c2, &b, 1) == 1 && read(s, &b, 1) == 1 && b == 'x';
    printf("first connect: %s; unwinder before: %s, after: %s; second connect: %s\n",
           r == -1 && err == EIO ? "EIO" : strerror(err), before ? "loaded" : "absent",
           after ? "loaded" : "absent", ok ? "ok" : "failed");
    return 0;
}
