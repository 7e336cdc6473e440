/* uv_echo: the echo server and client of the runtime conformance suite on libuv, in its usual
 * configuration: one default loop, callbacks, no threads.
 *
 *   uv_echo server --port-file F [--host H] [--deadline S]
 *   uv_echo client --host H --port P --test echo|rr|many [--count N] [--conns N] [--bytes N]
 *   (either role) --embed poll|epoll: the loop nested in an outer poll() / epoll set
 *
 * Protocol (tests/runtimes/README.md): a connection's first byte is its command. 'E': the
 * server echoes every following byte until the client's EOF, then shuts down its side and
 * closes. 'Q': the server stops listening and exits once its connections are done, printing
 * "OK server ...". The client prints "OK client <test>" when every reply matched byte for byte;
 * anything else prints FAIL and exits non-zero. SIGALRM is the watchdog (exit 3).
 */
#define _GNU_SOURCE
#include <poll.h>
#include <signal.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>
#include <uv.h>

static const char *role = "?";
static const char *host = "127.0.0.1";
static int port;
static const char *port_file;
static const char *test = "echo";
static int count = 2000, nconns = 50, nbytes = 256 << 10, deadline = 40;
static const char *embed = "none"; /* none | poll | epoll */

static uv_loop_t *loop;
static char first_error[512];
static int errors;

static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (errors++ == 0) vsnprintf(first_error, sizeof first_error, fmt, ap);
  va_end(ap);
}

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FAIL watchdog: still running at the deadline\n";
  ssize_t r = write(1, msg, sizeof msg - 1);
  (void)r;
  _exit(3);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  buf->base = malloc(suggested);
  buf->len = buf->base ? suggested : 0;
}

static int parse_addr(struct sockaddr_storage *ss, int p) {
  if (strchr(host, ':')) return uv_ip6_addr(host, p, (struct sockaddr_in6 *)ss);
  return uv_ip4_addr(host, p, (struct sockaddr_in *)ss);
}

/* The loop, run as uv_run does it, or embedded in an outer loop the way GUI toolkits and
 * language runtimes embed libuv: sleep on the loop's backend fd (its epoll set) in poll() or
 * in an outer epoll set, then let libuv handle what is ready without blocking. */
static void run_loop(void) {
  if (!strcmp(embed, "none")) {
    uv_run(loop, UV_RUN_DEFAULT);
    return;
  }
  int outer = -1;
  if (!strcmp(embed, "epoll")) {
    outer = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data = {.u64 = 0x5eedULL}};
    if (outer < 0 || epoll_ctl(outer, EPOLL_CTL_ADD, uv_backend_fd(loop), &ev) != 0)
      fail("outer epoll set: %s", strerror(errno));
  }
  while (uv_loop_alive(loop)) {
    int timeout = uv_backend_timeout(loop);
    if (outer >= 0) {
      struct epoll_event ev;
      int n = epoll_wait(outer, &ev, 1, timeout);
      if (n == 1 && ev.data.u64 != 0x5eedULL) fail("outer epoll set: foreign data word %#llx",
                                                  (unsigned long long)ev.data.u64);
    } else {
      struct pollfd p = {.fd = uv_backend_fd(loop), .events = POLLIN};
      poll(&p, 1, timeout);
    }
    uv_run(loop, UV_RUN_NOWAIT);
  }
  if (outer >= 0) close(outer);
}

/* ---- server ---------------------------------------------------------------------------------- */

static uv_tcp_t listener;
static int quitting, active, served;
static unsigned long long echoed;

struct sconn {
  uv_tcp_t tcp;
  int got_cmd;
  int paused;
  uv_shutdown_t shut;
};

struct wreq {
  uv_write_t req;
  char *base;
};

static void on_sclose(uv_handle_t *h) {
  free(h->data);
  active--;
}

static void on_sshutdown(uv_shutdown_t *req, int status) {
  if (status < 0) fail("shutdown: %s", uv_strerror(status));
  uv_close((uv_handle_t *)req->handle, on_sclose);
}

static void on_secho(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static void on_swrite(uv_write_t *req, int status) {
  struct wreq *w = (struct wreq *)req;
  struct sconn *c = req->handle->data;
  free(w->base);
  free(w);
  if (status < 0) {
    fail("echo write: %s", uv_strerror(status));
    return;
  }
  if (c->paused && uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) < (256 << 10)) {
    c->paused = 0;
    uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, on_secho);
  }
}

static void on_secho(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  struct sconn *c = s->data;
  if (nread < 0) {
    free(buf->base);
    uv_read_stop(s);
    if (nread != UV_EOF) {
      fail("read: %s", uv_strerror((int)nread));
      uv_close((uv_handle_t *)s, on_sclose);
    } else if (!c->got_cmd) {
      fail("EOF before the command byte");
      uv_close((uv_handle_t *)s, on_sclose);
    } else {
      /* Runs after the queued echo writes. */
      uv_shutdown(&c->shut, s, on_sshutdown);
    }
    return;
  }
  if (nread == 0) {
    free(buf->base);
    return;
  }
  size_t off = 0;
  if (!c->got_cmd) {
    c->got_cmd = 1;
    off = 1;
    if (buf->base[0] == 'Q') {
      free(buf->base);
      uv_read_stop(s);
      if (!quitting) {
        quitting = 1;
        uv_close((uv_handle_t *)&listener, NULL);
      }
      uv_close((uv_handle_t *)s, on_sclose);
      return;
    }
    if (buf->base[0] != 'E') {
      fail("unknown command byte 0x%02x", (unsigned char)buf->base[0]);
      free(buf->base);
      uv_read_stop(s);
      uv_close((uv_handle_t *)s, on_sclose);
      return;
    }
  }
  if ((size_t)nread == off) {
    free(buf->base);
    return;
  }
  echoed += (size_t)nread - off;
  struct wreq *w = malloc(sizeof *w);
  w->base = buf->base;
  uv_buf_t b = uv_buf_init(buf->base + off, (unsigned)((size_t)nread - off));
  int r = uv_write(&w->req, s, &b, 1, on_swrite);
  if (r < 0) {
    fail("uv_write: %s", uv_strerror(r));
    free(w->base);
    free(w);
    return;
  }
  if (uv_stream_get_write_queue_size(s) > (1 << 20)) {
    c->paused = 1;
    uv_read_stop(s);
  }
}

static void on_connection(uv_stream_t *l, int status) {
  if (status < 0) {
    fail("accept: %s", uv_strerror(status));
    return;
  }
  struct sconn *c = calloc(1, sizeof *c);
  uv_tcp_init(loop, &c->tcp);
  c->tcp.data = c;
  active++;
  int r = uv_accept(l, (uv_stream_t *)&c->tcp);
  if (r < 0) {
    fail("uv_accept: %s", uv_strerror(r));
    uv_close((uv_handle_t *)&c->tcp, on_sclose);
    return;
  }
  served++;
  uv_tcp_nodelay(&c->tcp, 1);
  uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, on_secho);
}

static int server(void) {
  struct sockaddr_storage ss;
  int r = parse_addr(&ss, 0);
  if (r < 0) {
    printf("FAIL server: address %s: %s\n", host, uv_strerror(r));
    return 1;
  }
  uv_tcp_init(loop, &listener);
  if ((r = uv_tcp_bind(&listener, (struct sockaddr *)&ss, 0)) < 0 ||
      (r = uv_listen((uv_stream_t *)&listener, 512, on_connection)) < 0) {
    printf("FAIL server: bind/listen %s: %s\n", host, uv_strerror(r));
    return 1;
  }
  struct sockaddr_storage me;
  int len = sizeof me;
  uv_tcp_getsockname(&listener, (struct sockaddr *)&me, &len);
  int p = ntohs(me.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&me)->sin6_port
                                         : ((struct sockaddr_in *)&me)->sin_port);
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", port_file);
  FILE *f = fopen(tmp, "w");
  if (!f || fprintf(f, "%d\n", p) < 0 || fclose(f) != 0 || rename(tmp, port_file) != 0) {
    printf("FAIL server: cannot write %s\n", port_file);
    return 1;
  }
  run_loop();
  if (errors) {
    printf("FAIL server: %d error(s), first: %s\n", errors, first_error);
    return 1;
  }
  printf("OK server conns=%d bytes=%llu\n", served, echoed);
  return 0;
}

/* ---- client ---------------------------------------------------------------------------------- */

struct cconn {
  uv_tcp_t tcp;
  uv_connect_t creq;
  uv_write_t cmdreq;
  uv_write_t wreq;
  uv_shutdown_t shut;
  int id;
  int nmsgs;        /* messages in the plan */
  const int *sizes; /* their sizes */
  int k;            /* current message */
  char *msg;        /* its bytes */
  size_t got;       /* bytes of its reply so far */
  int written;      /* its write completed */
  int finished;     /* half-closed after the last message */
  int quit;         /* the final 'Q' connection */
  char cmd;
};

static int done_conns, total_conns;
static struct sockaddr_storage server_addr;

static void pattern(char *p, int c, int k, size_t n) {
  uint64_t x = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)c << 32) ^ (uint64_t)(k + 1);
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    for (size_t j = 0; j < 8 && i + j < n; j++) p[i + j] = (char)(x >> (8 * j));
  }
}

static void start_quit(void);

static void on_cclose(uv_handle_t *h) {
  struct cconn *c = h->data;
  int was_quit = c->quit;
  free(c->msg);
  free(c);
  if (was_quit) return;
  if (++done_conns == total_conns) start_quit();
}

static void cclose(struct cconn *c) {
  if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_cclose);
}

static void send_next(struct cconn *c);

static void on_cshutdown(uv_shutdown_t *req, int status) {
  struct cconn *c = req->handle->data;
  if (status < 0) {
    fail("connection %d: shutdown: %s", c->id, uv_strerror(status));
    cclose(c);
  }
}

static void maybe_advance(struct cconn *c) {
  if (!c->written || c->got < (size_t)c->sizes[c->k]) return;
  free(c->msg);
  c->msg = NULL;
  c->k++;
  send_next(c);
}

static void on_cwrite(uv_write_t *req, int status) {
  struct cconn *c = req->handle->data;
  if (status < 0) {
    fail("connection %d: message %d: write: %s", c->id, c->k, uv_strerror(status));
    cclose(c);
    return;
  }
  if (c->quit) return;
  c->written = 1;
  maybe_advance(c);
}

static void send_next(struct cconn *c) {
  if (c->k == c->nmsgs) {
    c->finished = 1;
    uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_cshutdown);
    return;
  }
  size_t n = (size_t)c->sizes[c->k];
  c->msg = malloc(n);
  pattern(c->msg, c->id, c->k, n);
  c->got = 0;
  c->written = 0;
  uv_buf_t b = uv_buf_init(c->msg, (unsigned)n);
  int r = uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, on_cwrite);
  if (r < 0) {
    fail("connection %d: uv_write: %s", c->id, uv_strerror(r));
    cclose(c);
  }
}

static void on_cread(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  struct cconn *c = s->data;
  if (nread < 0) {
    free(buf->base);
    if (nread != UV_EOF && c->finished)
      fail("connection %d: read: %s after the last reply (waiting for EOF)", c->id,
           uv_strerror((int)nread));
    else if (nread != UV_EOF)
      fail("connection %d: read: %s in message %d after %zu byte(s)", c->id,
           uv_strerror((int)nread), c->k, c->got);
    else if (!c->finished && !c->quit)
      fail("connection %d: EOF in message %d after %zu byte(s)", c->id, c->k, c->got);
    cclose(c);
    return;
  }
  if (nread > 0 && c->quit) {
    fail("quit: %zd unexpected byte(s)", nread);
  } else if (nread > 0) {
    size_t want = c->finished ? 0 : (size_t)c->sizes[c->k] - c->got;
    if ((size_t)nread > want) {
      fail("connection %d: %zd byte(s) where %zu were due (message %d)", c->id, nread, want, c->k);
      free(buf->base);
      cclose(c);
      return;
    }
    if (memcmp(buf->base, c->msg + c->got, (size_t)nread) != 0) {
      size_t at = 0;
      while (buf->base[at] == c->msg[c->got + at]) at++;
      fail("connection %d: message %d (%d B): reply differs from byte %zu on", c->id, c->k,
           c->sizes[c->k], c->got + at);
      free(buf->base);
      cclose(c);
      return;
    }
    c->got += (size_t)nread;
    maybe_advance(c);
  }
  free(buf->base);
}

static void on_cmdwrite(uv_write_t *req, int status) {
  struct cconn *c = req->handle->data;
  if (status < 0) {
    fail("connection %d: command byte: %s", c->id, uv_strerror(status));
    cclose(c);
  }
}

static void on_connect(uv_connect_t *req, int status) {
  struct cconn *c = req->handle->data;
  if (status < 0) {
    fail("connection %d: connect: %s", c->id, uv_strerror(status));
    cclose(c);
    return;
  }
  uv_tcp_nodelay(&c->tcp, 1);
  uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, on_cread);
  uv_buf_t b = uv_buf_init(&c->cmd, 1);
  /* The command byte goes first: libuv keeps the writes of a stream in order. */
  int r = uv_write(&c->cmdreq, (uv_stream_t *)&c->tcp, &b, 1, on_cmdwrite);
  if (r < 0) {
    fail("connection %d: command byte: %s", c->id, uv_strerror(r));
    cclose(c);
    return;
  }
  if (c->quit) return;
  send_next(c);
}

static void start_conn(int id, int nmsgs, const int *sizes, int quit) {
  struct cconn *c = calloc(1, sizeof *c);
  c->id = id;
  c->nmsgs = nmsgs;
  c->sizes = sizes;
  c->quit = quit;
  c->cmd = quit ? 'Q' : 'E';
  uv_tcp_init(loop, &c->tcp);
  c->tcp.data = c;
  int r = uv_tcp_connect(&c->creq, &c->tcp, (struct sockaddr *)&server_addr, on_connect);
  if (r < 0) {
    fail("connection %d: uv_tcp_connect: %s", id, uv_strerror(r));
    cclose(c);
  }
}

static void start_quit(void) { start_conn(-1, 0, NULL, 1); }

static int client(void) {
  static const int echo_sizes[] = {1,     2,     7,      100,    1000,   1460,
                                   4096,  65535, 65536,  100003, 262144, 1 << 20};
  int r = parse_addr(&server_addr, port);
  if (r < 0) {
    printf("FAIL client: address %s: %s\n", host, uv_strerror(r));
    return 1;
  }
  int *sizes = NULL;
  if (strcmp(test, "echo") == 0) {
    total_conns = 1;
    start_conn(0, (int)(sizeof echo_sizes / sizeof echo_sizes[0]), echo_sizes, 0);
  } else if (strcmp(test, "rr") == 0) {
    sizes = malloc(sizeof(int) * (size_t)count);
    for (int i = 0; i < count; i++) sizes[i] = 1 + (i * 7) % 64;
    total_conns = 1;
    start_conn(0, count, sizes, 0);
  } else if (strcmp(test, "many") == 0) {
    sizes = malloc(sizeof(int));
    sizes[0] = nbytes;
    total_conns = nconns;
    for (int i = 0; i < nconns; i++) start_conn(i, 1, sizes, 0);
  } else {
    printf("FAIL client: unknown test %s\n", test);
    return 2;
  }
  run_loop();
  free(sizes);
  if (errors) {
    printf("FAIL client %s: %d error(s), first: %s\n", test, errors, first_error);
    return 1;
  }
  printf("OK client %s\n", test);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    printf("FAIL usage: uv_echo server|client [options]\n");
    return 2;
  }
  role = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const char *f = argv[i], *v = argv[i + 1];
    if (!strcmp(f, "--host")) host = v;
    else if (!strcmp(f, "--port")) port = atoi(v);
    else if (!strcmp(f, "--port-file")) port_file = v;
    else if (!strcmp(f, "--test")) test = v;
    else if (!strcmp(f, "--count")) count = atoi(v);
    else if (!strcmp(f, "--conns")) nconns = atoi(v);
    else if (!strcmp(f, "--bytes")) nbytes = atoi(v);
    else if (!strcmp(f, "--deadline")) deadline = atoi(v);
    else if (!strcmp(f, "--embed")) embed = v;
    else {
      printf("FAIL unknown option %s\n", f);
      return 2;
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);
  signal(SIGALRM, on_alarm);
  alarm((unsigned)deadline);
  loop = uv_default_loop();
  int rc;
  if (!strcmp(role, "server")) {
    if (!port_file) {
      printf("FAIL server: --port-file is required\n");
      return 2;
    }
    rc = server();
  } else if (!strcmp(role, "client")) {
    rc = client();
  } else {
    printf("FAIL unknown role %s\n", role);
    return 2;
  }
  uv_loop_close(loop);
  return rc;
}
