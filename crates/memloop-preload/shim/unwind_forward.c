/* The engine's unwinder entry points, forwarded to the C library's unwinder (libgcc_s),
 * which is loaded the first time one is called instead of with the engine.
 *
 * Why: libgcc_s's constructor asks the CPU for its features, ~30 `cpuid`s, and in a virtual
 * machine each one traps (3.5 µs here): loading libgcc_s took ~140 µs, half of what loading
 * the engine cost a C program (which has no libgcc_s of its own) at its first socket. The
 * engine only unwinds on a panic it contains, or when a thread blocked in one of its calls is
 * cancelled — and then glibc has loaded libgcc_s itself.
 *
 * Why forward rather than link libgcc_eh statically: a process must have one unwinder. glibc's
 * thread cancellation runs libgcc_s's; with a second one inside the engine, a cancellation
 * that crossed the engine's frames mixed the two and failed (5 of 20 runs). Forwarding keeps
 * the one glibc uses.
 *
 * Linked into the engine as a static archive ahead of `-lgcc_s`, whose `--as-needed` entry
 * then drops out; these symbols stay local to the engine (its version script exports only its
 * hooks). */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

struct _Unwind_Context;
struct _Unwind_Exception;
typedef int _Unwind_Reason_Code;
typedef _Unwind_Reason_Code (*_Unwind_Trace_Fn)(struct _Unwind_Context *, void *);

static _Atomic(void *) lib;

/* Loads libgcc_s now (the engine calls it before anything may unwind through it soon: a
 * `pthread_cancel`). Null if it cannot be loaded. */
void *memloop_unwinder_load(void) {
    void *h = atomic_load_explicit(&lib, memory_order_acquire);
    if (!h) {
        h = dlopen("libgcc_s.so.1", RTLD_NOW | RTLD_LOCAL);
        if (h) {
            atomic_store_explicit(&lib, h, memory_order_release);
        }
    }
    return h;
}

static void *resolve(const char *name) {
    void *h = memloop_unwinder_load();
    void *f = h ? dlsym(h, name) : NULL;
    if (!f) {
        /* Nothing can unwind without it: say so rather than crash somewhere obscure. */
        static const char msg[] = "memloop: libgcc_s.so.1 is needed to unwind and cannot be "
                                  "loaded\n";
        (void)!write(2, msg, sizeof msg - 1);
        abort();
    }
    return f;
}

/* One forwarder: the real function, looked up on first use (a benign race: both threads
 * store the same pointer). Tail calls, so the unwinder never has to step through us. */
#define FORWARD(ret, name, params, args)                                                      \
    ret name params {                                                                         \
        static _Atomic(ret(*) params) real;                                                   \
        ret(*f) params = atomic_load_explicit(&real, memory_order_relaxed);                   \
        if (!f) {                                                                             \
            f = (ret(*) params)resolve(#name);                                                \
            atomic_store_explicit(&real, f, memory_order_relaxed);                            \
        }                                                                                     \
        return f args;                                                                        \
    }

FORWARD(_Unwind_Reason_Code, _Unwind_RaiseException, (struct _Unwind_Exception * e), (e))
FORWARD(void, _Unwind_Resume, (struct _Unwind_Exception * e), (e))
FORWARD(void, _Unwind_DeleteException, (struct _Unwind_Exception * e), (e))
FORWARD(_Unwind_Reason_Code, _Unwind_Backtrace, (_Unwind_Trace_Fn fn, void *arg), (fn, arg))
FORWARD(uintptr_t, _Unwind_GetIP, (struct _Unwind_Context * c), (c))
FORWARD(uintptr_t, _Unwind_GetIPInfo, (struct _Unwind_Context * c, int *before), (c, before))
FORWARD(void *, _Unwind_GetLanguageSpecificData, (struct _Unwind_Context * c), (c))
FORWARD(uintptr_t, _Unwind_GetRegionStart, (struct _Unwind_Context * c), (c))
FORWARD(uintptr_t, _Unwind_GetTextRelBase, (struct _Unwind_Context * c), (c))
FORWARD(uintptr_t, _Unwind_GetDataRelBase, (struct _Unwind_Context * c), (c))
FORWARD(void, _Unwind_SetGR, (struct _Unwind_Context * c, int i, uintptr_t v), (c, i, v))
FORWARD(void, _Unwind_SetIP, (struct _Unwind_Context * c, uintptr_t v), (c, v))
