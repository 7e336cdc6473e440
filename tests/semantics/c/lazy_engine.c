/* When libmemloop.so loads its engine (libmemloop_preload.so), seen from a program.
 *
 *   lazy_engine idle      no socket: the engine is not in the process, nor in a fork child,
 *                         nor in the program that child execs, whose environment shows nothing
 *                         of what the shim told it; the same through vfork; prints
 *                         "idle: engine absent".
 *   lazy_engine fork-while-loading
 *                         a thread's first socket loads the engine (paused there by
 *                         MEMLOOP_TEST_PAUSE=engine-load:…) while the main thread forks; the
 *                         child's own socket must not wait for a load that will never finish
 *                         in it (5 s alarm); prints "fork-while-loading: child not stuck".
 *   lazy_engine clearenv  the environment is cleared before the first socket; then a
 *                         connection to our own listener carries a message each way: the
 *                         engine must still use the region the process started with (the
 *                         test checks the ring in the log); prints "clearenv: engine loaded".
 *
 * Exit 0 when every check holds; 1 with a line saying which did not.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static int engine_loaded(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) {
        return -1;
    }
    char line[4096];
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "libmemloop_preload.so")) {
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static int fail(const char *what) {
    printf("FAIL %s\n", what);
    return 1;
}

static char self_path[4096];

/* The program a clean (engine-less) process execs: no engine, and no trace of the shim's
 * hint in its environment. */
static int exec_child(void) {
    if (getenv("MEMLOOP_CLEAN_EXEC")) {
        return 5;
    }
    return engine_loaded() == 0 ? 0 : 6;
}

static int idle(void) {
    if (engine_loaded() != 0) {
        return fail("idle: the engine is loaded in a process without sockets");
    }
    pid_t p = fork();
    if (p == 0) {
        if (engine_loaded() != 0) {
            _exit(3);
        }
        char *argv[] = {self_path, "exec-child", NULL};
        execve(self_path, argv, environ);
        _exit(4);
    }
    int st = 0;
    if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAIL idle: fork child exit %d (3: engine loaded; 4: exec failed; 5: hint "
               "visible after exec; 6: engine loaded after exec)\n",
               WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return 1;
    }
    /* vfork is the C library's here (a jump to it): the child execs in our memory. */
    p = vfork();
    if (p == 0) {
        char *argv[] = {self_path, "exec-child", NULL};
        execve(self_path, argv, environ);
        _exit(4);
    }
    if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAIL idle: vfork child exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return 1;
    }
    printf("idle: engine absent\n");
    return 0;
}

static void *first_socket(void *arg) {
    (void)arg;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s >= 0) {
        close(s);
    }
    return NULL;
}

static int fork_while_loading(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, first_socket, NULL) != 0) {
        return fail("fork-while-loading: pthread_create");
    }
    struct timespec ms100 = {0, 100 * 1000 * 1000};
    nanosleep(&ms100, NULL);
    pid_t p = fork();
    if (p == 0) {
        alarm(5);
        int s = socket(AF_INET, SOCK_STREAM, 0);
        _exit(s >= 0 ? 0 : 3);
    }
    int st = 0;
    if (p < 0 || waitpid(p, &st, 0) != p) {
        return fail("fork-while-loading: fork");
    }
    pthread_join(t, NULL);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAIL fork-while-loading: the child %s %d\n",
               WIFSIGNALED(st) ? "was killed by signal" : "exited", WIFSIGNALED(st) ?
               WTERMSIG(st) : WEXITSTATUS(st));
        return 1;
    }
    printf("fork-while-loading: child not stuck\n");
    return 0;
}

static int exchange(int a, int b) {
    char buf[6] = {0};
    return send(a, "hello", 5, 0) == 5 && recv(b, buf, 5, MSG_WAITALL) == 5 &&
           strcmp(buf, "hello") == 0 && send(b, "back!", 5, 0) == 5 &&
           recv(a, buf, 5, MSG_WAITALL) == 5 && strcmp(buf, "back!") == 0;
}

static int clear_env(void) {
    if (!getenv("MEMLOOP_REGION")) {
        return fail("clearenv: started without MEMLOOP_REGION");
    }
    if (clearenv() != 0 || getenv("MEMLOOP_REGION")) {
        return fail("clearenv: clearenv");
    }
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(l, 4) != 0 ||
        getsockname(l, (struct sockaddr *)&sa, &len) != 0) {
        return fail("clearenv: listener");
    }
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&sa, sizeof sa) != 0) {
        return fail("clearenv: connect");
    }
    int s = accept(l, NULL, NULL);
    if (s < 0 || !exchange(c, s)) {
        return fail("clearenv: exchange");
    }
    if (engine_loaded() != 1) {
        return fail("clearenv: the engine is not loaded after a socket");
    }
    close(c);
    close(s);
    close(l);
    printf("clearenv: engine loaded\n");
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    self_path[n > 0 ? n : 0] = '\0';
    if (strcmp(mode, "exec-child") == 0) {
        return exec_child();
    }
    if (strcmp(mode, "idle") == 0) {
        return idle();
    }
    if (strcmp(mode, "fork-while-loading") == 0) {
        return fork_while_loading();
    }
    if (strcmp(mode, "clearenv") == 0) {
        return clear_env();
    }
    return fail("usage: lazy_engine idle|clearenv");
}
