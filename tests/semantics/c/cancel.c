/* pthread_cancel of a thread blocked in a socket call on a connection (recv, read, poll,
 * epoll_wait, select) or in accept: each is a cancellation point, so the thread must end cancelled and be
 * joinable at once. Client and server are one process, so under the preload the connection is
 * a ring. Usage: cancel MODE... ; exit 0 when every mode was cancelled, 1 when one returned
 * instead, 3 when one was still blocked after 3 s (the watchdog). */
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

static int conn, listener;
static const char *mode;

static void *blocker(void *unused) {
  char b[16];
  (void)unused;
  if (!strcmp(mode, "recv")) {
    recv(conn, b, sizeof b, 0);
  } else if (!strcmp(mode, "read")) {
    if (read(conn, b, sizeof b) < 0) perror("read");
  } else if (!strcmp(mode, "poll")) {
    struct pollfd p = {conn, POLLIN, 0};
    poll(&p, 1, -1);
  } else if (!strcmp(mode, "epoll")) {
    int e = epoll_create1(0);
    struct epoll_event ev = {EPOLLIN, {0}};
    epoll_ctl(e, EPOLL_CTL_ADD, conn, &ev);
    epoll_wait(e, &ev, 1, -1);
  } else if (!strcmp(mode, "accept")) {
    accept(listener, NULL, NULL);
  } else if (!strcmp(mode, "select")) {
    fd_set r;
    FD_ZERO(&r);
    FD_SET(conn, &r);
    select(conn + 1, &r, NULL, NULL, NULL);
  }
  return NULL;
}

static void hung(int sig) {
  (void)sig;
  static const char m[] = "still blocked 3 s after pthread_cancel\n";
  if (write(1, m, sizeof m - 1) < 0) _exit(4);
  _exit(3);
}

int main(int argc, char **argv) {
  int l = listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in a = {0};
  socklen_t n = sizeof a;
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(l, (void *)&a, sizeof a) || listen(l, 4) || getsockname(l, (void *)&a, &n)) {
    perror("listen");
    return 2;
  }
  signal(SIGALRM, hung);
  for (int i = 1; i < argc; i++) {
    void *r;
    pthread_t t;
    int s;
    mode = argv[i];
    conn = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(conn, (void *)&a, sizeof a) || (s = accept(l, NULL, NULL)) < 0) {
      perror("connect");
      return 2;
    }
    pthread_create(&t, NULL, blocker, NULL);
    usleep(200000);
    alarm(3);
    pthread_cancel(t);
    pthread_join(t, &r);
    alarm(0);
    printf("%s: %s\n", mode, r == PTHREAD_CANCELED ? "cancelled" : "returned");
    fflush(stdout);
    if (r != PTHREAD_CANCELED) return 1;
    close(s);
    close(conn);
  }
  return 0;
}
