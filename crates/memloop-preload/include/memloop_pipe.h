/*
 * memloop_pipe.h — the pipe service (vPipe) from C: hand "move these bytes from this
 * descriptor to that one" to `memloop pipe serve`, which moves them with the kernel's
 * zero-copy primitives (copy_file_range, sendfile, splice) and charges the work to this
 * process's tenant.
 *
 * Hand-written (not generated): the functions are exported by the preload library that
 * `memloop run` preloads (libmemloop.so, which forwards them to its engine,
 * libmemloop_preload.so, loading it at the first call). They are declared weak here, so a
 * program links without any memloop library and finds them when it runs under
 * `memloop run` (or with the engine preloaded by itself): test memloop_pipe_available()
 * first — without the preload every one of them is a null pointer.
 *
 * The service: the socket named by MEMLOOP_PIPE_SOCKET, else the region's,
 * `<region file>.wake/pipe` (`memloop pipe serve` with the same region). Each process has one
 * connection, made at its first call; the tenant is MEMLOOP_PIPE_TENANT (unset: the service
 * names it after the process's control group), its weight MEMLOOP_PIPE_WEIGHT (1 to 1000,
 * default 1). A service that cannot be reached is asked again at most once a second (until
 * then calls fail at once). A fork child never uses its parent's connection: it makes its own
 * at its first call, and the parent's transfers and completions are not its own.
 *
 * Every function returns a negative errno on failure and leaves `errno` alone. Errors of
 * the library: -ENOSYS (no memloop engine: MEMLOOP_DISABLE is set, or it cannot be loaded),
 * -ENOENT (no service at the socket), -ECONNREFUSED (the service refused this client, e.g.
 * one of another protocol version), -EBADF (a descriptor that is not open), -EBUSY (a memloop
 * ring connection that cannot leave its ring yet: read what its peer sent first), -EIO (an
 * internal failure), or the errno of a system call on the way (-EMFILE, -EPIPE, …).
 * A transfer's own error is the kernel's (EPIPE, ECONNRESET, …), EBADF for a descriptor the
 * service cannot use that way (a directory, a listening socket, opened for the wrong
 * direction), EIO when the source ends before `len` bytes, ECANCELED when cancelled, and
 * ECONNABORTED when the connection to the service broke first (then how many bytes moved is
 * not known: 0 is reported).
 *
 * Descriptors: any pair of regular files, stream sockets (TCP or Unix) and pipes (and a
 * character device as the sink). They are the caller's open files, shared with the service
 * for the transfer: files are read and written at their own positions, which advance by the
 * bytes moved (as with sendfile(out, in, NULL, n)); their flags are never changed. A memloop
 * ring connection leaves its ring for good first (as when it is passed with SCM_RIGHTS).
 * Do not read the source or write the sink yourself while a transfer on them is in flight.
 *
 * Threads: every function may be called from any thread at once. These are not
 * cancellation points, and a signal does not interrupt their waits.
 */
#ifndef MEMLOOP_PIPE_H
#define MEMLOOP_PIPE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEMLOOP_PIPE_WEAK __attribute__((weak))

/* Moves `len` bytes (0: until the source ends) from src_fd to dst_fd and waits for them: the
 * bytes moved (`len` when it was not 0), or -errno — the library's error, or the transfer's
 * own, also when it failed part way (the count is then not reported: use
 * memloop_pipe_submit/memloop_pipe_complete to have both). */
MEMLOOP_PIPE_WEAK int64_t memloop_pipe(int src_fd, int dst_fd, uint64_t len);

/* Starts the same transfer and returns at once (it blocks only when the service already has
 * this process's maximum of transfers in flight, 64 by default: push-back): the transfer's
 * id (> 0, unique within the process), or -errno. Its completion comes through
 * memloop_pipe_complete. The descriptors may be closed by the caller once this returns (the
 * service holds its own references until the transfer ends). */
MEMLOOP_PIPE_WEAK int64_t memloop_pipe_submit(int src_fd, int dst_fd, uint64_t len);

/* A descriptor that polls readable (poll, select, epoll) while a completion is waiting for
 * memloop_pipe_complete, or -errno. It belongs to the library: do not read it or close it.
 * It may report readable just before a completion is ready (memloop_pipe_complete with
 * wait 0 then says -EAGAIN): poll again. The same descriptor for the life of the process
 * (a fork child gets its own from its own call). */
MEMLOOP_PIPE_WEAK int memloop_pipe_fd(void);

/* The next completion of a transfer started with memloop_pipe_submit, in the order they
 * finish. Returns 0 when one was taken: *id is the transfer's, *moved the bytes it wrote to
 * the sink, *error 0 if it succeeded or the transfer's errno (a positive number); any of the
 * three pointers may be NULL. Otherwise -EAGAIN (wait == 0 and none is there yet: poll
 * memloop_pipe_fd), -ENOENT (no transfer is in flight: none will come), or another -errno.
 * With wait != 0 it waits for the next one. */
MEMLOOP_PIPE_WEAK int memloop_pipe_complete(int64_t *id, uint64_t *moved, int *error, int wait);

/* Asks the service to stop transfer `id` (at once if it is queued or waiting for its source
 * or sink, else after the chunk it is moving). Its completion still comes: error ECANCELED
 * with the bytes moved until then, or how it ended if it was done already. 0, -ENOENT (no
 * transfer of that id is in flight), or -errno. */
MEMLOOP_PIPE_WEAK int memloop_pipe_cancel(int64_t id);

/* Whether the functions above are there (the program runs under `memloop run`). */
static inline int memloop_pipe_available(void) {
    return memloop_pipe != 0 && memloop_pipe_submit != 0 && memloop_pipe_fd != 0 &&
           memloop_pipe_complete != 0 && memloop_pipe_cancel != 0;
}

#ifdef __cplusplus
}
#endif

#endif /* MEMLOOP_PIPE_H */
