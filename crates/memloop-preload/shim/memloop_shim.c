/*
 * libmemloop.so: what `memloop run` preloads. It loads the engine (libmemloop_preload.so, the
 * Rust library beside it) only when the process first needs it, and until then every call it
 * intercepts goes straight to the next definition (the C library's).
 *
 * Why: every process of an opted-in run or container loads the preload library, and most of
 * them (shells, scripts, build tools) never open an inet socket. The engine costs such a
 * process its loading (a 1.3 MB image and its relocations) and every fork its memory
 * mappings; this shim costs one small image and a look at the inherited fds.
 *
 * The engine is needed by a process that
 *   - creates an inet socket (socket() with AF_INET or AF_INET6),
 *   - creates an epoll set (a thread may wait on it from before the first socket, and the
 *     engine must see that wait to keep its own registrations out of what it reports),
 *   - inherits an inet socket or an epoll set across exec (found at load, in /proc/self/fd),
 *   - may receive one from another process (recvmsg/recvmmsg with a control buffer,
 *     pidfd_getfd, or syscall(SYS_pidfd_getfd)),
 *   - sets up io_uring through syscall() (the engine then keeps its connections on TCP),
 *   - calls the pipe service's functions (memloop_pipe*, include/memloop_pipe.h, which are
 *     the engine's), or a large sendfile with MEMLOOP_PIPE_SENDFILE=1 (the engine hands it
 *     to the pipe service).
 * Nothing else can be a ring connection or hold one, so nothing else needs it.
 *
 * Once loaded, each intercepted call goes to the engine's export of the same name (one
 * indirect call). The engine finds the C library's functions through memloop_shim_next (the
 * definitions after this shim, so other preloaded libraries keep their place), reads the
 * MEMLOOP_* settings as they were when the process started (memloop_shim_env), and leaves
 * the fork and exit handlers to this shim, which registered them at load: a library's fork
 * handlers must run before the program's child handlers, which may already use sockets.
 *
 * Plain C with no dependency but the C library: no unwinder or runtime of its own.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define ENGINE_NAME "libmemloop_preload.so"

/* Every intercepted function: return type, name, parameters, arguments, and whether a fork
 * child that has not needed the engine yet may make the call without it (see "A fork child
 * that has not needed the engine yet"). */
#define HOOKS(X)                                                                              \
    X(int, accept, (int fd, struct sockaddr *a, socklen_t *l), (fd, a, l), passable(fd))      \
    X(int, accept4, (int fd, struct sockaddr *a, socklen_t *l, int fl), (fd, a, l, fl),       \
      passable(fd))                                                                           \
    X(int, bind, (int fd, const struct sockaddr *a, socklen_t l), (fd, a, l), passable(fd))   \
    X(int, close, (int fd), (fd), closing_passable(fd))                                       \
    X(int, close_range, (unsigned a, unsigned b, int fl), (a, b, fl), range_passable(a, b))   \
    X(int, connect, (int fd, const struct sockaddr *a, socklen_t l), (fd, a, l),              \
      passable(fd))                                                                           \
    X(int, dup, (int fd), (fd), passable(fd))                                                 \
    X(int, dup2, (int a, int b), (a, b), dup_passable(a, b))                                  \
    X(int, dup3, (int a, int b, int fl), (a, b, fl), dup_passable(a, b))                      \
    X(int, epoll_ctl, (int ep, int op, int fd, struct epoll_event *e), (ep, op, fd, e),       \
      not_ours(ep) && not_ours(fd))                                                           \
    X(int, epoll_pwait, (int ep, struct epoll_event *e, int n, int t, const sigset_t *s),     \
      (ep, e, n, t, s), not_ours(ep))                                                         \
    X(int, epoll_pwait2,                                                                      \
      (int ep, struct epoll_event *e, int n, const struct timespec *t, const sigset_t *s),    \
      (ep, e, n, t, s), not_ours(ep))                                                         \
    X(int, epoll_wait, (int ep, struct epoll_event *e, int n, int t), (ep, e, n, t),          \
      not_ours(ep))                                                                           \
    X(int, getsockopt, (int fd, int l, int o, void *v, socklen_t *n), (fd, l, o, v, n),       \
      passable(fd))                                                                           \
    X(int, listen, (int fd, int n), (fd, n), passable(fd))                                    \
    X(int, poll, (struct pollfd *f, nfds_t n, int t), (f, n, t), pollfds_passable(f, n))      \
    X(int, ppoll, (struct pollfd *f, nfds_t n, const struct timespec *t, const sigset_t *s),  \
      (f, n, t, s), pollfds_passable(f, n))                                                   \
    X(int, pselect,                                                                           \
      (int n, fd_set *r, fd_set *w, fd_set *x, const struct timespec *t, const sigset_t *s),  \
      (n, r, w, x, t, s), fdsets_passable(n, r, w, x))                                        \
    X(int, pthread_cancel, (pthread_t t), (t), 0)                                             \
    X(ssize_t, read, (int fd, void *b, size_t n), (fd, b, n), passable(fd))                   \
    X(ssize_t, readv, (int fd, const struct iovec *v, int n), (fd, v, n), passable(fd))       \
    X(ssize_t, recv, (int fd, void *b, size_t n, int fl), (fd, b, n, fl), passable(fd))       \
    X(ssize_t, recvfrom,                                                                      \
      (int fd, void *b, size_t n, int fl, struct sockaddr *a, socklen_t *l),                  \
      (fd, b, n, fl, a, l), passable(fd))                                                     \
    X(int, select, (int n, fd_set *r, fd_set *w, fd_set *x, struct timeval *t),               \
      (n, r, w, x, t), fdsets_passable(n, r, w, x))                                           \
    X(ssize_t, send, (int fd, const void *b, size_t n, int fl), (fd, b, n, fl), passable(fd)) \
    X(int, sendmmsg, (int fd, struct mmsghdr *m, unsigned n, int fl), (fd, m, n, fl),         \
      passable(fd) && !mmsg_control(m, n))                                                    \
    X(ssize_t, sendmsg, (int fd, const struct msghdr *m, int fl), (fd, m, fl),                \
      passable(fd) && !(m && m->msg_controllen > 0))                                          \
    X(ssize_t, sendto,                                                                        \
      (int fd, const void *b, size_t n, int fl, const struct sockaddr *a, socklen_t l),       \
      (fd, b, n, fl, a, l), passable(fd))                                                     \
    X(int, setsockopt, (int fd, int l, int o, const void *v, socklen_t n), (fd, l, o, v, n),  \
      passable(fd))                                                                           \
    X(int, shutdown, (int fd, int how), (fd, how), passable(fd))                              \
    X(ssize_t, splice, (int i, loff_t *oi, int o, loff_t *oo, size_t n, unsigned fl),         \
      (i, oi, o, oo, n, fl), passable(i) && passable(o))                                      \
    X(ssize_t, write, (int fd, const void *b, size_t n), (fd, b, n), passable(fd))            \
    X(ssize_t, writev, (int fd, const struct iovec *v, int n), (fd, v, n), passable(fd))

/* Intercepted with their own bodies below (they decide whether to load the engine, or have
 * no prototype in the headers, or are variadic). */
#define OTHERS(X)                                                                             \
    X(int, socket, (int d, int t, int p))                                                     \
    X(int, epoll_create, (int n))                                                             \
    X(int, epoll_create1, (int fl))                                                           \
    X(ssize_t, recvmsg, (int fd, struct msghdr *m, int fl))                                   \
    X(int, recvmmsg, (int fd, struct mmsghdr *m, unsigned n, int fl, struct timespec *t))     \
    X(int, pidfd_getfd, (int pidfd, int fd, unsigned fl))                                     \
    X(long, syscall, (long n, long a, long b, long c, long d, long e, long f))                \
    X(int, fcntl, (int fd, int cmd, unsigned long arg))                                       \
    X(int, fcntl64, (int fd, int cmd, unsigned long arg))                                     \
    X(int, ioctl, (int fd, unsigned long req, unsigned long arg))                             \
    X(void, closefrom, (int fd))                                                              \
    X(int, __poll_chk, (struct pollfd * f, nfds_t n, int t, size_t len))                      \
    X(int, __ppoll_chk,                                                                       \
      (struct pollfd * f, nfds_t n, const struct timespec *t, const sigset_t *s, size_t len)) \
    X(ssize_t, __read_chk, (int fd, void *b, size_t n, size_t len))                           \
    X(ssize_t, __recv_chk, (int fd, void *b, size_t n, size_t len, int fl))                   \
    X(ssize_t, __recvfrom_chk,                                                                \
      (int fd, void *b, size_t n, size_t len, int fl, struct sockaddr *a, socklen_t *l))      \
    X(ssize_t, sendfile, (int o, int i, off_t *off, size_t n))                                \
    X(ssize_t, sendfile64, (int o, int i, off64_t *off, size_t n))                            \
    X(pid_t, vfork, (void))                                                                   \
    X(int, execv, (const char *p, char *const *a))                                            \
    X(int, execve, (const char *p, char *const *a, char *const *e))                           \
    X(int, execvp, (const char *p, char *const *a))                                           \
    X(int, execvpe, (const char *p, char *const *a, char *const *e))                          \
    X(int, fexecve, (int fd, char *const *a, char *const *e))                                 \
    X(int, posix_spawn,                                                                       \
      (pid_t * p, const char *f, const posix_spawn_file_actions_t *fa,                        \
       const posix_spawnattr_t *at, char *const *a, char *const *e))                          \
    X(int, posix_spawnp,                                                                      \
      (pid_t * p, const char *f, const posix_spawn_file_actions_t *fa,                        \
       const posix_spawnattr_t *at, char *const *a, char *const *e))

/* Function pointer types, and one table for the next definitions and one for the engine's. */
#define TYPE(ret, name, params, ...) typedef ret(*name##_fn) params;
HOOKS(TYPE)
OTHERS(TYPE)
#define FIELD(ret, name, ...) name##_fn name;
struct table {
    HOOKS(FIELD) OTHERS(FIELD)
};
static struct table next, engine;

/* 0: not loaded; 1: loading (by the thread holding `load_lock`); 2: loaded; 3: failed. */
static atomic_int state;
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t loader;

/* Where `vfork` jumps (see there). */
__attribute__((used)) static void *vfork_target;

typedef void (*void_fn)(void);
static void_fn engine_fork_prepare, engine_fork_parent, engine_fork_child, engine_exit;
/* The prepare handler forwarded (the parent and child handlers follow it, whatever the
 * engine's state meanwhile). */
static int fork_forwarded;

/* A fork child that has not needed the engine yet (see the section of that name). */
#define PLAN_MAX 64
#define LOCKS_MAX 16

/* Written by the engine's prepare handler (a child copies it). */
static struct {
    int defer, nplain, nlisteners, nlocks;
    int plain[PLAN_MAX], listeners[PLAN_MAX], locks[LOCKS_MAX];
} plan;

/* 1: such a child, its handler not run yet; 2: running it (on `waker`); 0: not one. */
static atomic_int pending;
static pthread_t waker;
/* The plain connections it closed meanwhile (their entries go when the handler runs). */
static int nclosed, closed_fds[2 * PLAN_MAX];

/* The engine's table of kinds (0: not the engine's) up to its highest fd, taken at every
 * fork (no fd of the engine's appears in such a child), and its deferred handler. */
static const unsigned char *kinds;
static size_t nkinds;
typedef const unsigned char *(*kinds_fn)(size_t *);
static kinds_fn engine_kinds;
typedef void (*deferred_fn)(const int *, int);
static deferred_fn engine_fork_child_deferred;

/* The engine's pipe-service functions (include/memloop_pipe.h); optional: an engine without
 * them makes ours return -ENOSYS. */
typedef int64_t (*pipe_fn)(int, int, uint64_t);
typedef int (*pipe_fd_fn)(void);
typedef int (*pipe_complete_fn)(int64_t *, uint64_t *, int *, int);
typedef int (*pipe_cancel_fn)(int64_t);
static struct {
    pipe_fn pipe, submit;
    pipe_fd_fn fd;
    pipe_complete_fn complete;
    pipe_cancel_fn cancel;
} engine_pipe;

static inline int loaded(void) {
    return atomic_load_explicit(&state, memory_order_acquire) == 2;
}

/* The next definition of `name` (the C library's, or another preloaded library's). */
EXPORT void *memloop_shim_next(const char *name) {
    return dlsym(RTLD_NEXT, name);
}

static void *next_or_die(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) {
        static const char msg[] = "memloop: cannot resolve a C library function\n";
        (void)!write(2, msg, sizeof msg - 1);
        abort();
    }
    return p;
}

/* The real function, resolved on first use (a fork child inherits the resolved table; two
 * threads resolving the same one store the same pointer). */
#define GETTER(ret, name, ...)                                                                \
    __attribute__((unused)) static name##_fn next_##name(void) {                              \
        if (!next.name) {                                                                     \
            next.name = (name##_fn)next_or_die(#name);                                        \
        }                                                                                     \
        return next.name;                                                                     \
    }
HOOKS(GETTER)
OTHERS(GETTER)
#define NEXT(name) next_##name()

/* ---- settings as the process started with them ------------------------------------------- */

#define MAX_SETTINGS 32
static char *settings[MAX_SETTINGS];
/* Copies, as a program may overwrite its original environment strings (a process title
 * written over them); in a static buffer, as the first malloc of a process that never
 * needs one costs it a heap. */
static char settings_buf[4096];

static void capture_settings(void) {
    int n = 0;
    size_t used = 0;
    for (char **e = environ; e && *e && n < MAX_SETTINGS; e++) {
        if (strncmp(*e, "MEMLOOP_", 8) != 0) {
            continue;
        }
        size_t len = strlen(*e) + 1;
        if (used + len <= sizeof settings_buf) {
            settings[n++] = memcpy(settings_buf + used, *e, len);
            used += len;
        } else if ((settings[n] = strdup(*e)) != NULL) {
            n++;
        }
    }
}

/* The value `name` had in the environment when the process started (NULL: unset). The engine
 * loads later, maybe after the program changed its environment (`clearenv` in a daemon). */
EXPORT const char *memloop_shim_env(const char *name) {
    size_t len = strlen(name);
    for (int i = 0; i < MAX_SETTINGS && settings[i]; i++) {
        if (strncmp(settings[i], name, len) == 0 && settings[i][len] == '=') {
            return settings[i] + len + 1;
        }
    }
    return NULL;
}

/* 1 until the start-up look (or the exec hint) showed that nothing inherited needs the
 * engine: then every inet socket and epoll set the process holds was made (or received)
 * through one of our triggers, and the engine, loaded by one, need not look again. */
static int may_have_inherited = 1;

EXPORT int memloop_shim_inherited(void) {
    return may_have_inherited;
}

static int disabled(void) {
    const char *d = memloop_shim_env("MEMLOOP_DISABLE");
    return d && *d && strcmp(d, "0") != 0;
}

/* ---- loading the engine ------------------------------------------------------------------- */

static void engine_path(char *out, size_t cap) {
    const char *set = memloop_shim_env("MEMLOOP_ENGINE");
    if (set && *set) {
        snprintf(out, cap, "%s", set);
        return;
    }
    Dl_info info;
    if (dladdr((void *)&memloop_shim_next, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash) {
            snprintf(out, cap, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname,
                     ENGINE_NAME);
            return;
        }
    }
    snprintf(out, cap, "%s", ENGINE_NAME);
}

static void open_engine(void) {
    char path[4096];
    engine_path(path, sizeof path);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        /* The program goes on, on the kernel path (as when the region cannot be opened). */
        const char *why = dlerror();
        char msg[4400];
        int n = snprintf(msg, sizeof msg, "memloop: cannot load %s (%s): the program runs on "
                         "the kernel path\n", path, why ? why : "unknown error");
        if (n > 0) {
            (void)!NEXT(write)(2, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
        }
        atomic_store_explicit(&state, 3, memory_order_release);
        return;
    }
#define RESOLVE(ret, name, ...) engine.name = (name##_fn)dlsym(h, #name);
    HOOKS(RESOLVE)
    OTHERS(RESOLVE)
    engine_fork_prepare = (void_fn)dlsym(h, "memloop_engine_fork_prepare");
    engine_fork_parent = (void_fn)dlsym(h, "memloop_engine_fork_parent");
    engine_fork_child = (void_fn)dlsym(h, "memloop_engine_fork_child");
    engine_exit = (void_fn)dlsym(h, "memloop_engine_exit");
    /* (Optional: without them, every fork child runs the engine's handler at once.) */
    engine_fork_child_deferred = (deferred_fn)dlsym(h, "memloop_engine_fork_child_deferred");
    engine_kinds = (kinds_fn)dlsym(h, "memloop_engine_kinds");
    engine_pipe.pipe = (pipe_fn)dlsym(h, "memloop_pipe");
    engine_pipe.submit = (pipe_fn)dlsym(h, "memloop_pipe_submit");
    engine_pipe.fd = (pipe_fd_fn)dlsym(h, "memloop_pipe_fd");
    engine_pipe.complete = (pipe_complete_fn)dlsym(h, "memloop_pipe_complete");
    engine_pipe.cancel = (pipe_cancel_fn)dlsym(h, "memloop_pipe_cancel");
    /* An engine missing one of them is not ours (or from another version): not used. */
#define CHECK(ret, name, ...) ok = ok && engine.name;
    int ok = engine_fork_prepare && engine_fork_parent && engine_fork_child && engine_exit;
    HOOKS(CHECK)
    OTHERS(CHECK)
    if (!ok) {
        static const char msg[] = "memloop: the engine beside libmemloop.so is from another "
                                  "version: the program runs on the kernel path\n";
        (void)!NEXT(write)(2, msg, sizeof msg - 1);
        atomic_store_explicit(&state, 3, memory_order_release);
        return;
    }
    atomic_store_explicit(&state, 2, memory_order_release);
    vfork_target = (void *)engine.vfork;
}

/* Loads the engine once. Calls the engine's own start-up makes meanwhile (on this thread)
 * go to the next definitions; other threads wait for it. */
static void need_engine(void) {
    if (atomic_load_explicit(&state, memory_order_acquire) >= 2 || disabled()) {
        return;
    }
    if (atomic_load_explicit(&state, memory_order_acquire) == 1 &&
        pthread_equal(loader, pthread_self())) {
        return;
    }
    int saved = errno;
    pthread_mutex_lock(&load_lock);
    if (atomic_load_explicit(&state, memory_order_acquire) == 0) {
        loader = pthread_self();
        atomic_store_explicit(&state, 1, memory_order_release);
        open_engine();
    }
    pthread_mutex_unlock(&load_lock);
    errno = saved;
}

/* ---- a fork child that has not needed the engine yet ------------------------------------- */

/* A fork-per-connection server has the engine loaded (it listens), and its child used to run
 * the engine's child handler, then our code for each call on its connection, then our exit
 * handler: each page of the engine it touched was a fault, +27 % per connection. When the
 * parent holds nothing of ours but plain TCP connections and listeners, the engine tells us so
 * in its prepare handler (`memloop_shim_fork_plan`), and the child puts the engine's handler
 * off: it closes its copies of the engine's lock fds at once (a child holding them would keep
 * its parent "alive"), then makes every call that needs nothing of the engine without it —
 * calls on fds that are not the engine's (its table of kinds says so: one byte per fd), and
 * the data calls and `close` on those plain connections (the child never counts into their
 * records). The first call that needs more (a new inet socket, an epoll set, a listener, a
 * poll over a ring, fds passed in a control message, …) runs the handler, then goes to the
 * engine as in any child. */

static int count_ok(int n, int max) {
    return n >= 0 && n <= max;
}

EXPORT void memloop_shim_fork_plan(int defer, const int *plain, int nplain,
                                   const int *listeners, int nlisteners, const int *locks,
                                   int nlocks) {
    plan.defer = defer && count_ok(nplain, PLAN_MAX) && count_ok(nlisteners, PLAN_MAX) &&
                 count_ok(nlocks, LOCKS_MAX);
    plan.nplain = plan.defer ? nplain : 0;
    plan.nlisteners = plan.defer ? nlisteners : 0;
    plan.nlocks = plan.defer ? nlocks : 0;
    memcpy(plan.plain, plain, sizeof(int) * (size_t)plan.nplain);
    memcpy(plan.listeners, listeners, sizeof(int) * (size_t)plan.nlisteners);
    memcpy(plan.locks, locks, sizeof(int) * (size_t)plan.nlocks);
}

static inline int pending_child(void) {
    return atomic_load_explicit(&pending, memory_order_acquire) != 0;
}

static int not_ours(int fd) {
    return fd < 0 || (size_t)fd >= nkinds || __atomic_load_n(&kinds[fd], __ATOMIC_RELAXED) == 0;
}

static int index_of(const int *v, int n, int fd) {
    for (int i = 0; i < n; i++) {
        if (v[i] == fd) {
            return i;
        }
    }
    return -1;
}

static int passable(int fd) {
    return not_ours(fd) || index_of(plan.plain, plan.nplain, fd) >= 0;
}

/* Takes fd out of list `v` (of `*n`) if it is there. */
static int take(int *v, int *n, int fd) {
    int i = index_of(v, *n, fd);
    if (i >= 0) {
        v[i] = v[--*n];
    }
    return i >= 0;
}

/* A close the child may make itself: of an fd not the engine's, or of a plain connection or
 * a listener (noted: their entries go when the engine's handler runs). */
static int closing_passable(int fd) {
    if (!take(plan.plain, &plan.nplain, fd) && !take(plan.listeners, &plan.nlisteners, fd)) {
        return not_ours(fd);
    }
    if (nclosed < 2 * PLAN_MAX) {
        closed_fds[nclosed++] = fd;
        return 1;
    }
    return 0; /* (cannot note it: the engine closes it) */
}

/* closefrom/close_range over [low, last]: every fd of the engine's there must be a plain
 * connection or a listener (noted as closed), or a lock fd the child closed already. */
static int range_passable(unsigned low, unsigned last) {
    for (size_t fd = low; fd < nkinds && fd <= last; fd++) {
        int f = (int)fd;
        if (!not_ours(f) && index_of(plan.locks, plan.nlocks, f) < 0 &&
            index_of(plan.plain, plan.nplain, f) < 0 &&
            index_of(plan.listeners, plan.nlisteners, f) < 0) {
            return 0;
        }
    }
    for (size_t fd = low; fd < nkinds && fd <= last; fd++) {
        int f = (int)fd;
        if (index_of(plan.locks, plan.nlocks, f) < 0 && !not_ours(f) && !closing_passable(f)) {
            return 0;
        }
    }
    return 1;
}

/* dup2/dup3 of a passable fd over one that is not the engine's or a plain connection (which
 * it closes). */
static int dup_passable(int a, int b) {
    if (!passable(a)) {
        return 0;
    }
    return a == b || closing_passable(b);
}

static int pollfds_passable(const struct pollfd *f, nfds_t n) {
    for (nfds_t i = 0; f && i < n; i++) {
        if (!passable(f[i].fd)) {
            return 0;
        }
    }
    return 1;
}

static int fdsets_passable(int n, fd_set *r, fd_set *w, fd_set *x) {
    for (int fd = 0; fd < n && fd < FD_SETSIZE; fd++) {
        int in = (r && FD_ISSET(fd, r)) || (w && FD_ISSET(fd, w)) || (x && FD_ISSET(fd, x));
        if (in && !passable(fd)) {
            return 0;
        }
    }
    return 1;
}

static int mmsg_control(const struct mmsghdr *m, unsigned n) {
    for (unsigned i = 0; m && i < n; i++) {
        if (m[i].msg_hdr.msg_controllen > 0) {
            return 1;
        }
    }
    return 0;
}

/* The child needs the engine now: its fork handler runs first (once; other threads wait for
 * it, and calls the handler itself makes on this thread go through). */
static void wake_child(void) {
    int one = 1;
    if (atomic_compare_exchange_strong(&pending, &one, 2)) {
        waker = pthread_self();
        engine_fork_child_deferred(closed_fds, nclosed);
        nclosed = 0;
        atomic_store_explicit(&pending, 0, memory_order_release);
        return;
    }
    while (atomic_load_explicit(&pending, memory_order_acquire) == 2 &&
           !pthread_equal(waker, pthread_self())) {
        sched_yield();
    }
}

/* In such a child: the call goes to the next definition if `pass`, else the child wakes. */
#define DEFERRED(pass)                                                                        \
    (pending_child() && ((pass) || (wake_child(), 0)) && pending_child())

/* ---- the intercepted functions ------------------------------------------------------------- */

#define FORWARD(ret, name, params, args, pass)                                                \
    EXPORT ret name params {                                                                  \
        if (loaded() && !DEFERRED(pass)) {                                                    \
            return engine.name args;                                                          \
        }                                                                                     \
        return NEXT(name) args;                                                               \
    }
HOOKS(FORWARD)

static int inet(int domain) {
    return domain == AF_INET || domain == AF_INET6;
}

EXPORT int socket(int d, int t, int p) {
    if (!loaded() && inet(d)) {
        need_engine();
    }
    return loaded() && !DEFERRED(!inet(d)) ? engine.socket(d, t, p) : NEXT(socket)(d, t, p);
}

EXPORT int epoll_create(int n) {
    need_engine();
    return loaded() && !DEFERRED(0) ? engine.epoll_create(n) : NEXT(epoll_create)(n);
}

EXPORT int epoll_create1(int fl) {
    need_engine();
    return loaded() && !DEFERRED(0) ? engine.epoll_create1(fl) : NEXT(epoll_create1)(fl);
}

/* A control buffer may bring fds (SCM_RIGHTS): one of them may be a ring connection. */
EXPORT ssize_t recvmsg(int fd, struct msghdr *m, int fl) {
    if (!loaded() && m && m->msg_controllen > 0) {
        need_engine();
    }
    int to_engine = loaded() && !DEFERRED(passable(fd) && !(m && m->msg_controllen > 0));
    return to_engine ? engine.recvmsg(fd, m, fl) : NEXT(recvmsg)(fd, m, fl);
}

EXPORT int recvmmsg(int fd, struct mmsghdr *m, unsigned n, int fl, struct timespec *t) {
    if (!loaded()) {
        for (unsigned i = 0; m && i < n; i++) {
            if (m[i].msg_hdr.msg_controllen > 0) {
                need_engine();
                break;
            }
        }
    }
    int to_engine = loaded() && !DEFERRED(passable(fd) && !mmsg_control(m, n));
    return to_engine ? engine.recvmmsg(fd, m, n, fl, t) : NEXT(recvmmsg)(fd, m, n, fl, t);
}

EXPORT int pidfd_getfd(int pidfd, int fd, unsigned fl) {
    need_engine();
    return loaded() && !DEFERRED(0) ? engine.pidfd_getfd(pidfd, fd, fl)
                                    : NEXT(pidfd_getfd)(pidfd, fd, fl);
}

/* What the functions that load the engine do, made through syscall(): a socket or epoll set
 * (the engine must know of it), an fd from elsewhere (pidfd_getfd, recvmsg), io_uring (the
 * engine then keeps the process's connections on TCP). */
static int syscall_needs_engine(long n, long a) {
    switch (n) {
    case SYS_socket:
        return inet((int)a);
    case SYS_epoll_create:
    case SYS_epoll_create1:
    case SYS_pidfd_getfd:
    case SYS_io_uring_setup:
    case SYS_recvmsg:
    case SYS_recvmmsg:
        return 1;
    default:
        return 0;
    }
}

/* Variadic in the C library; on x86_64 and aarch64 a variadic integer or pointer argument
 * travels like a fixed one, so the largest possible set is taken and handed on. */
EXPORT long syscall(long n, ...) {
    va_list ap;
    va_start(ap, n);
    long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
    long d = va_arg(ap, long), e = va_arg(ap, long), f = va_arg(ap, long);
    va_end(ap);
    /* pidfd_getfd: an fd from another process; io_uring_setup: the engine must know that the
     * process may do I/O where it cannot see it (its connections then stay on TCP). */
    if (!loaded() && syscall_needs_engine(n, a)) {
        need_engine();
    }
    if (loaded() && !DEFERRED(!syscall_needs_engine(n, a))) {
        return engine.syscall(n, a, b, c, d, e, f);
    }
    return NEXT(syscall)(n, a, b, c, d, e, f);
}

#define VARIADIC(name, t1, t2)                                                                \
    EXPORT int name(t1 x, t2 y, ...) {                                                        \
        va_list ap;                                                                           \
        va_start(ap, y);                                                                      \
        unsigned long arg = va_arg(ap, unsigned long);                                        \
        va_end(ap);                                                                           \
        return loaded() && !DEFERRED(passable(x)) ? engine.name(x, y, arg)                    \
                                                  : NEXT(name)(x, y, arg);                    \
    }
VARIADIC(fcntl, int, int)
VARIADIC(fcntl64, int, int)
VARIADIC(ioctl, int, unsigned long)

EXPORT void closefrom(int fd) {
    if (loaded() && !DEFERRED(fd >= 0 && range_passable((unsigned)fd, ~0u))) {
        engine.closefrom(fd);
    } else {
        NEXT(closefrom)(fd);
    }
}

/* ---- sendfile and the pipe service ------------------------------------------------------- */

/* MEMLOOP_PIPE_SENDFILE=1: a sendfile of at least MEMLOOP_PIPE_SENDFILE_MIN bytes (64 KiB) is
 * the engine's to hand to the pipe service, whatever the descriptors are: the engine is loaded
 * for it (a process that never made an inet socket has not loaded it) and a fork child that
 * has not needed the engine yet wakes it. The engine decides again (same settings). */
static int pipe_sendfile(size_t n) {
    /* -1: not read yet; 0: off. (Threads reading it at once store the same value.) */
    static _Atomic long long pipe_min = -1;
    long long min = atomic_load_explicit(&pipe_min, memory_order_relaxed);
    if (min < 0) {
        const char *on = memloop_shim_env("MEMLOOP_PIPE_SENDFILE");
        const char *m = memloop_shim_env("MEMLOOP_PIPE_SENDFILE_MIN");
        long long v = 64 << 10;
        if (m && *m) {
            char *end;
            long long parsed = strtoll(m, &end, 10);
            if (*end == '\0' && parsed >= 0) {
                v = parsed > 0 ? parsed : 1;
            }
        }
        min = (on && *on && strcmp(on, "0") != 0) ? v : 0;
        atomic_store_explicit(&pipe_min, min, memory_order_relaxed);
    }
    return min > 0 && (unsigned long long)n >= (unsigned long long)min;
}

#define SENDFILE(name, offt)                                                                  \
    EXPORT ssize_t name(int o, int i, offt *off, size_t n) {                                  \
        int piped = pipe_sendfile(n);                                                         \
        if (!loaded() && piped) {                                                             \
            need_engine();                                                                    \
        }                                                                                     \
        return loaded() && !DEFERRED(passable(o) && passable(i) && !piped)                    \
                   ? engine.name(o, i, off, n)                                                \
                   : NEXT(name)(o, i, off, n);                                                \
    }
SENDFILE(sendfile, off_t)
SENDFILE(sendfile64, off64_t)

/* The pipe service's C functions (include/memloop_pipe.h) are the engine's: these load it
 * (unless MEMLOOP_DISABLE is set), run a deferred fork child's handler, and forward; without
 * an engine (disabled, not loadable, or one without them) they return -ENOSYS. */
static int pipe_engine(void) {
    need_engine();
    return loaded() && !DEFERRED(0) && engine_pipe.pipe && engine_pipe.submit &&
           engine_pipe.fd && engine_pipe.complete && engine_pipe.cancel;
}

EXPORT int64_t memloop_pipe(int src_fd, int dst_fd, uint64_t len) {
    return pipe_engine() ? engine_pipe.pipe(src_fd, dst_fd, len) : -ENOSYS;
}

EXPORT int64_t memloop_pipe_submit(int src_fd, int dst_fd, uint64_t len) {
    return pipe_engine() ? engine_pipe.submit(src_fd, dst_fd, len) : -ENOSYS;
}

EXPORT int memloop_pipe_fd(void) {
    return pipe_engine() ? engine_pipe.fd() : -ENOSYS;
}

EXPORT int memloop_pipe_complete(int64_t *id, uint64_t *moved, int *error, int wait) {
    return pipe_engine() ? engine_pipe.complete(id, moved, error, wait) : -ENOSYS;
}

EXPORT int memloop_pipe_cancel(int64_t id) {
    return pipe_engine() ? engine_pipe.cancel(id) : -ENOSYS;
}

#define CHK(ret, name, params, args, pass)                                                    \
    EXPORT ret name params {                                                                  \
        return loaded() && !DEFERRED(pass) ? engine.name args : NEXT(name) args;              \
    }
CHK(int, __poll_chk, (struct pollfd * f, nfds_t n, int t, size_t len), (f, n, t, len),
    pollfds_passable(f, n))
CHK(int, __ppoll_chk,
    (struct pollfd * f, nfds_t n, const struct timespec *t, const sigset_t *s, size_t len),
    (f, n, t, s, len), pollfds_passable(f, n))
CHK(ssize_t, __read_chk, (int fd, void *b, size_t n, size_t len), (fd, b, n, len),
    passable(fd))
CHK(ssize_t, __recv_chk, (int fd, void *b, size_t n, size_t len, int fl), (fd, b, n, len, fl),
    passable(fd))
CHK(ssize_t, __recvfrom_chk,
    (int fd, void *b, size_t n, size_t len, int fl, struct sockaddr *a, socklen_t *l),
    (fd, b, n, len, fl, a, l), passable(fd))

/* vfork: the C library's until the engine is loaded (a shell vforks for every command, and a
 * full fork of it costs ~130 µs more here); then the engine's, which forks (a vforked child
 * would share the engine's memory and skip the fork handlers). A wrapper cannot call the real
 * vfork (its child would return through the wrapper's frame and the parent then resume on a
 * clobbered stack), so `vfork` is a jump to `vfork_target`, set at load and when the engine
 * loads. */

#if defined(__x86_64__)
__attribute__((naked)) EXPORT pid_t vfork(void) {
    __asm__("jmp *vfork_target(%rip)");
}
#elif defined(__aarch64__)
__attribute__((naked)) EXPORT pid_t vfork(void) {
    __asm__("adrp x16, vfork_target\n"
            "ldr x16, [x16, :lo12:vfork_target]\n"
            "br x16");
}
#else
EXPORT pid_t vfork(void) {
    return loaded() ? engine.vfork() : fork();
}
#endif

static pid_t fork_as_vfork(void) {
    return fork();
}

/* ---- exec: telling the next image there is nothing to adopt --------------------------------- */

/* An image that never loaded the engine holds no inet socket and no epoll set (each would
 * have loaded it), so the image it execs inherits none: it is told so by CLEAN_EXEC in the
 * environment it gets, and skips its look at /proc/self/fd (most of what the shim costs a
 * process that opens no socket). The variable is removed at load, before the program can copy
 * its environment, so it never outlives the exec it was made for. An image with the engine
 * execs through the engine's hooks, without it; so do the exec paths no hook sees (system(),
 * popen()): the next image then looks. */
#define CLEAN_EXEC "MEMLOOP_CLEAN_EXEC=1"
#define CLEAN_EXEC_NAME "MEMLOOP_CLEAN_EXEC"

static size_t env_len(char *const *e) {
    size_t n = 0;
    while (e && e[n]) {
        n++;
    }
    return n;
}

/* `env` with CLEAN_EXEC added, in `out` (room for env_len(env) + 2 entries): on the caller's
 * stack, as an exec may run where malloc may not (a fork child of a threaded program). */
static char *const *with_clean(char *const *env, char **out) {
    size_t n = 0;
    for (size_t i = 0; env && env[i]; i++) {
        if (strncmp(env[i], CLEAN_EXEC_NAME "=", sizeof CLEAN_EXEC_NAME) != 0) {
            out[n++] = env[i];
        }
    }
    out[n++] = (char *)CLEAN_EXEC;
    out[n] = NULL;
    return out;
}

#define WITH_CLEAN(env)                                                                       \
    char *hint_env[env_len(env) + 2];                                                         \
    with_clean(env, hint_env)

/* `name`: the engine's once loaded; else `next` with the environment `env` plus the hint. */
#define WITH_HINT(name, params, args, env, next, next_args)                                   \
    EXPORT int name params {                                                                  \
        if (loaded() && !DEFERRED(1)) {                                                       \
            return engine.name args;                                                          \
        }                                                                                     \
        if (loaded()) {                                                                       \
            return NEXT(name) args; /* (it holds inet sockets: no hint) */                    \
        }                                                                                     \
        WITH_CLEAN(env);                                                                      \
        return NEXT(next) next_args;                                                          \
    }
WITH_HINT(execve, (const char *p, char *const *a, char *const *e), (p, a, e), e, execve,
          (p, a, hint_env))
WITH_HINT(execv, (const char *p, char *const *a), (p, a), environ, execve, (p, a, hint_env))
WITH_HINT(execvpe, (const char *p, char *const *a, char *const *e), (p, a, e), e, execvpe,
          (p, a, hint_env))
WITH_HINT(execvp, (const char *p, char *const *a), (p, a), environ, execvpe, (p, a, hint_env))
WITH_HINT(fexecve, (int fd, char *const *a, char *const *e), (fd, a, e), e, fexecve,
          (fd, a, hint_env))
WITH_HINT(posix_spawn,
          (pid_t * p, const char *f, const posix_spawn_file_actions_t *fa,
           const posix_spawnattr_t *at, char *const *a, char *const *e),
          (p, f, fa, at, a, e), e, posix_spawn, (p, f, fa, at, a, hint_env))
WITH_HINT(posix_spawnp,
          (pid_t * p, const char *f, const posix_spawn_file_actions_t *fa,
           const posix_spawnattr_t *at, char *const *a, char *const *e),
          (p, f, fa, at, a, e), e, posix_spawnp, (p, f, fa, at, a, hint_env))

/* ---- fork and exit ---------------------------------------------------------------------------- */

/* Every next definition, resolved now: a fork child resolving one itself pays dlsym's lookup
 * and the loader's pages it touches, in every child (a shell's child execs, dups and
 * closes). */
static void resolve_all(void) {
#define RESOLVE_NEXT(ret, name, ...) (void)NEXT(name);
    HOOKS(RESOLVE_NEXT)
    OTHERS(RESOLVE_NEXT)
}

static void at_fork_prepare(void) {
    /* From the second fork on, as a process that forks once need not pay for it. */
    static int forks;
    if (forks < 2 && ++forks == 2) {
        resolve_all();
    }
    /* (A child that has not needed the engine forks without it: its grandchild is one too.) */
    plan.defer = 0;
    fork_forwarded = loaded() && !pending_child();
    if (fork_forwarded) {
        engine_fork_prepare();
        kinds = engine_kinds ? engine_kinds(&nkinds) : NULL;
    }
}

static void at_fork_parent(void) {
    if (fork_forwarded) {
        engine_fork_parent();
    }
}

static void at_fork_child(void) {
    if (atomic_load_explicit(&state, memory_order_acquire) == 1) {
        /* Another thread of the parent was loading the engine: it is not in this child, nor
         * will it finish here (the loader's locks stay held). The child stays on the kernel
         * path rather than wait for it forever. */
        pthread_mutex_init(&load_lock, NULL);
        atomic_store_explicit(&state, 3, memory_order_release);
    }
    if (!fork_forwarded) {
        return;
    }
    if (plan.defer && kinds && engine_fork_child_deferred) {
        for (int i = 0; i < plan.nlocks; i++) {
            NEXT(close)(plan.locks[i]);
        }
        nclosed = 0;
        atomic_store_explicit(&pending, 1, memory_order_release);
        return;
    }
    engine_fork_child();
}

static void at_exit(void) {
    if (loaded() && !pending_child()) {
        engine_exit();
    }
}

/* ---- start-up ------------------------------------------------------------------------------ */

/* Whether fd is an inet socket (one a previous program image may have had a ring for) or an
 * epoll set (which may hold such a socket's registrations). */
static int inherited_needs_engine(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        return 0;
    }
    if ((st.st_mode & S_IFMT) == 0) { /* an anonymous inode: epoll, eventfd, timerfd, ... */
        char path[64], link[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(path, link, sizeof link - 1);
        return n > 0 && (size_t)n == strlen("anon_inode:[eventpoll]") &&
               memcmp(link, "anon_inode:[eventpoll]", (size_t)n) == 0;
    }
    if (!S_ISSOCK(st.st_mode)) {
        return 0;
    }
    int domain = 0;
    socklen_t len = sizeof domain;
    return NEXT(getsockopt)(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && inet(domain);
}

/* An inherited inet socket needs the engine now (it may be a ring connection whose peer
 * writes into the ring, or a listener to publish), and so does an inherited epoll set. */
static int inherits_what_needs_engine(void) {
    int dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) {
        return 1; /* cannot tell: the engine looks itself */
    }
    char buf[4096];
    int found = 0;
    long n;
    while (!found && (n = getdents64(dir, buf, sizeof buf)) > 0) {
        for (long off = 0; off < n && !found;) {
            struct dirent64 *d = (struct dirent64 *)(buf + off);
            off += d->d_reclen;
            char *end;
            long fd = strtol(d->d_name, &end, 10);
            if (*end == '\0' && end != d->d_name && fd != dir && inherited_needs_engine((int)fd)) {
                found = 1;
            }
        }
    }
    NEXT(close)(dir);
    return found;
}

__attribute__((constructor)) static void on_load(void) {
    /* Read and removed first: neither the settings nor the program ever see it. */
    int clean = getenv(CLEAN_EXEC_NAME) != NULL;
    if (clean) {
        unsetenv(CLEAN_EXEC_NAME);
    }
    capture_settings();
    vfork_target = dlsym(RTLD_NEXT, "vfork");
    if (!vfork_target) {
        vfork_target = (void *)fork_as_vfork;
    }
    /* At load, before the program registers its own: a library's handlers must prepare last
     * and resume first (the program's child handler may use a socket). */
    pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    atexit(at_exit);
    if (disabled()) {
        return;
    }
    may_have_inherited = !clean && inherits_what_needs_engine();
    if (may_have_inherited) {
        need_engine();
    }
}
