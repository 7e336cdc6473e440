/*
 * zc_pipeline.c: a three-process zero-copy pipeline on memloop's C API.
 *
 *   source --(zc-mid-PID)--> middle --(zc-sink-PID)--> sink
 *
 * The source loans buffers of its own pool, fills each payload byte once, in place, and sends
 * the buffer (a descriptor moves, not the bytes). The middle stage reads what it receives in
 * place and forwards it without copying: most messages as a header loan of its own followed by
 * a sub-range of what it received (ml_port_sendv), every fifth one whole (ml_port_forward).
 * The sink reads every message in place and checks every payload byte against the pattern the
 * source wrote, end to end. Each stage reports how many payload bytes it copied: 0 for the
 * middle and the sink. The source's buffers come back only once the sink has freed the
 * messages naming them, through a process the source shares no channel with.
 *
 * Build (from crates/memloop-capi, after cargo build --release -p memloop-capi):
 *   cc -std=c11 -Wall -Wextra -O2 -Iinclude examples/c/zc_pipeline.c \
 *      -L../../target/release -lmemloop_zc -Wl,-rpath,$PWD/../../target/release -o zc_pipeline
 * Run:
 *   ./zc_pipeline [REGION [MESSAGES]]    (REGION "" or absent: $MEMLOOP_REGION / the default)
 * Exit status 0 and a last line "pipeline: ok" when every byte arrived intact.
 */
#define _POSIX_C_SOURCE 200809L
#include "memloop_zc.h"

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BUF_SIZE 16384u   /* the source's buffers (a multiple of 64: not rounded up) */
#define SRC_BUFFERS 8u    /* few, so that 1000 messages need every buffer back many times */
#define WAIT_MS 10000     /* no step of a healthy run takes that long */

/* The two stages the source forked (0 once reaped). */
static pid_t stages[2];
static const char *const stage_names[2] = {"middle", "sink"};

/* The byte at offset i of message seq's payload: a lost, repeated or mixed-up buffer shows. */
static uint8_t pattern(uint32_t seq, size_t i) {
    return (uint8_t)((seq * 31u + (uint32_t)i * 7u) ^ (uint32_t)(i >> 8));
}

/* The source's payload length of message seq: 1 to BUF_SIZE. */
static size_t payload_len(uint32_t seq) {
    return 1 + ((size_t)seq * 977u) % BUF_SIZE;
}

/* Message seq is forwarded whole (every fifth), else as header + sub-range. */
static int forwarded_whole(uint32_t seq) {
    return seq % 5 == 4;
}

/* The sub-range of a len-byte payload the middle forwards: [*off, *off + *n), never empty. */
static void sub_range(uint32_t seq, size_t len, size_t *off, size_t *n) {
    *off = (seq % 2 == 0) ? len / 4 : 0;
    size_t rest = len - *off;
    *n = (seq % 3 == 0 && rest > 1) ? rest / 2 : rest;
}

/* The middle stage's own header, the first segment of a message it re-sends. */
struct header {
    char tag[4]; /* "MID1" */
    uint32_t seq;
    uint64_t off; /* where the forwarded range starts in the source's payload */
    uint64_t len; /* its length */
};

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int fail(const char *stage, const char *what) {
    fprintf(stderr, "%s: %s: %s (%s)\n", stage, what, ml_last_error(),
            ml_strerror(ml_last_error_code()));
    return 1;
}

/* Connects to svc, waiting (bounded) for its listener to be bound. */
static ml_port *connect_when_bound(const char *stage, ml_node *node, const char *svc) {
    for (int i = 0; i < WAIT_MS / 10; i++) {
        ml_port *p = ml_port_connect(node, svc);
        if (p != NULL)
            return p;
        if (ml_last_error_code() != ML_NO_SERVICE)
            break;
        sleep_ms(10);
    }
    fail(stage, "connect");
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */

static int run_source(const char *region, const char *mid_svc, uint32_t messages) {
    ml_node *node = ml_node_join(region, "zc-source");
    if (node == NULL)
        return fail("source", "join");
    ml_pool *pool = ml_pool_create(node, BUF_SIZE, SRC_BUFFERS);
    if (pool == NULL)
        return fail("source", "pool");
    ml_port *out = connect_when_bound("source", node, mid_svc);
    if (out == NULL)
        return 1;
    uint64_t filled = 0, copied = 0;
    for (uint32_t seq = 0; seq < messages; seq++) {
        ml_loan *loan = ml_pool_loan(pool, WAIT_MS);
        if (loan == NULL)
            return fail("source", "loan");
        size_t cap = 0;
        uint8_t *buf = ml_loan_data(loan, &cap);
        if (buf == NULL || cap < BUF_SIZE) {
            fprintf(stderr, "source: a loan of %zu bytes\n", cap);
            return 1;
        }
        size_t len = payload_len(seq);
        for (size_t i = 0; i < len; i++)
            buf[i] = pattern(seq, i); /* the only time a payload byte is written */
        filled += len;
        int rc = ml_port_send_loan(out, loan, len, seq); /* consumes the loan */
        if (rc != ML_OK)
            return fail("source", "send");
    }
    if (ml_port_shutdown_send(out) != ML_OK)
        return fail("source", "shutdown");
    printf("source: sent %" PRIu32 " messages through %u buffers of %u bytes, "
           "filled %" PRIu64 " payload bytes once each, copied %" PRIu64 " payload bytes\n",
           messages, SRC_BUFFERS, BUF_SIZE, filled, copied);
    fflush(stdout);

    /* Both stages end once the stream has drained through them. */
    int bad = 0;
    for (int k = 0; k < 2; k++) {
        int st = 0;
        pid_t pid = waitpid(stages[k], &st, 0);
        stages[k] = 0;
        if (pid < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "source: the %s stage failed (status %#x)\n", stage_names[k], st);
            bad = 1;
        }
    }

    /* Every buffer came back: the sink freed the last messages naming them. */
    ml_loan *back[SRC_BUFFERS];
    unsigned got = 0;
    for (; got < SRC_BUFFERS; got++) {
        back[got] = ml_pool_loan(pool, WAIT_MS);
        if (back[got] == NULL)
            break;
    }
    printf("source: %u of %u buffers back in the pool\n", got, SRC_BUFFERS);
    if (got < SRC_BUFFERS) {
        fail("source", "loan after the run");
        bad = 1;
    }
    for (unsigned i = 0; i < got; i++)
        ml_loan_free(back[i]);
    ml_port_free(out);
    ml_pool_free(pool);
    ml_node_free(node);
    return bad;
}

static int run_middle(const char *region, const char *in_svc, const char *out_svc) {
    ml_node *node = ml_node_join(region, "zc-middle");
    if (node == NULL)
        return fail("middle", "join");
    ml_pool *headers = ml_pool_create(node, 64, 16);
    if (headers == NULL)
        return fail("middle", "pool");
    ml_listener *l = ml_listener_bind(node, in_svc);
    if (l == NULL)
        return fail("middle", "bind");
    ml_port *out = connect_when_bound("middle", node, out_svc);
    if (out == NULL)
        return 1;
    ml_port *in = ml_listener_accept(l, WAIT_MS);
    if (in == NULL)
        return fail("middle", "accept");
    uint32_t whole = 0, ranged = 0;
    uint64_t header_bytes = 0, left_out = 0, copied = 0;
    for (;;) {
        ml_msg *m = NULL;
        int rc = ml_port_recv(in, WAIT_MS, &m);
        if (rc == ML_EOF)
            break;
        if (rc != ML_OK)
            return fail("middle", "recv");
        uint32_t seq = ml_msg_user(m);
        size_t len = 0;
        if (ml_msg_segments(m) != 1 || ml_msg_segment(m, 0, &len) == NULL) {
            fprintf(stderr, "middle: message %" PRIu32 " is not one segment\n", seq);
            return 1;
        }
        if (forwarded_whole(seq)) {
            rc = ml_port_forward(out, m); /* every segment and the user word, by reference */
            whole++;
        } else {
            size_t off, n;
            sub_range(seq, len, &off, &n);
            ml_loan *h = ml_pool_loan(headers, WAIT_MS);
            if (h == NULL)
                return fail("middle", "header loan");
            size_t cap = 0;
            uint8_t *hb = ml_loan_data(h, &cap);
            struct header hd = {{'M', 'I', 'D', '1'}, seq, off, n};
            if (hb == NULL || cap < sizeof hd)
                return fail("middle", "header buffer");
            memcpy(hb, &hd, sizeof hd); /* our own header: not payload */
            header_bytes += sizeof hd;
            ml_part parts[2] = {
                {.loan = h, .len = sizeof hd},             /* consumed by the send */
                {.msg = m, .seg = 0, .off = off, .len = n}, /* forwarded in place */
            };
            rc = ml_port_sendv(out, parts, 2, seq);
            ranged++;
            left_out += len - n;
        }
        if (rc != ML_OK)
            return fail("middle", "forward");
        ml_msg_free(m); /* our hold ends; the sink holds its own now */
    }
    if (ml_port_shutdown_send(out) != ML_OK)
        return fail("middle", "shutdown");
    printf("middle: forwarded %" PRIu32 " messages (%" PRIu32 " whole, %" PRIu32
           " as own header + sub-range), wrote %" PRIu64 " header bytes, left out %" PRIu64
           " payload bytes, copied %" PRIu64 " payload bytes\n",
           whole + ranged, whole, ranged, header_bytes, left_out, copied);
    fflush(stdout);
    ml_port_free(in);
    ml_port_free(out);
    ml_listener_free(l);
    ml_pool_free(headers);
    ml_node_free(node);
    return 0;
}

static int run_sink(const char *region, const char *svc, uint32_t messages) {
    ml_node *node = ml_node_join(region, "zc-sink");
    if (node == NULL)
        return fail("sink", "join");
    ml_listener *l = ml_listener_bind(node, svc);
    if (l == NULL)
        return fail("sink", "bind");
    ml_port *in = ml_listener_accept(l, WAIT_MS);
    if (in == NULL)
        return fail("sink", "accept");
    uint32_t got = 0, with_header = 0, whole = 0;
    uint64_t checked = 0, bad = 0, copied = 0;
    for (;;) {
        ml_msg *m = NULL;
        int rc = ml_port_recv(in, WAIT_MS, &m);
        if (rc == ML_EOF)
            break;
        if (rc != ML_OK)
            return fail("sink", "recv");
        uint32_t seq = ml_msg_user(m);
        if (seq != got) {
            fprintf(stderr, "sink: message %" PRIu32 " where %" PRIu32 " was due\n", seq, got);
            return 1;
        }
        size_t want_off = 0, want_len = payload_len(seq);
        size_t nseg = ml_msg_segments(m), plen = 0;
        const uint8_t *payload = NULL;
        if (forwarded_whole(seq) && nseg == 1) {
            payload = ml_msg_segment(m, 0, &plen);
            whole++;
        } else if (!forwarded_whole(seq) && nseg == 2) {
            size_t hlen = 0;
            const uint8_t *hb = ml_msg_segment(m, 0, &hlen);
            struct header hd;
            if (hb == NULL || hlen != sizeof hd) {
                fprintf(stderr, "sink: message %" PRIu32 ": a header of %zu bytes\n", seq, hlen);
                return 1;
            }
            memcpy(&hd, hb, sizeof hd); /* the middle's header (aligned copy): not payload */
            sub_range(seq, want_len, &want_off, &want_len);
            if (memcmp(hd.tag, "MID1", 4) != 0 || hd.seq != seq || hd.off != want_off ||
                hd.len != want_len) {
                fprintf(stderr, "sink: message %" PRIu32 ": a wrong header\n", seq);
                return 1;
            }
            payload = ml_msg_segment(m, 1, &plen);
            with_header++;
        } else {
            fprintf(stderr, "sink: message %" PRIu32 " has %zu segments\n", seq, nseg);
            return 1;
        }
        if (payload == NULL || plen != want_len || ml_msg_len(m) < plen) {
            fprintf(stderr, "sink: message %" PRIu32 ": %zu payload bytes, %zu due\n", seq,
                    plen, want_len);
            return 1;
        }
        /* Read in place, in the source's buffer: every byte as the source wrote it. */
        for (size_t i = 0; i < plen; i++)
            bad += payload[i] != pattern(seq, want_off + i);
        checked += plen;
        got++;
        ml_msg_free(m); /* the last holder: the source's buffer (and the header) go back */
    }
    printf("sink: received %" PRIu32 " messages (%" PRIu32 " with the middle's header, %" PRIu32
           " whole), checked %" PRIu64 " payload bytes end to end, %" PRIu64
           " bad, copied %" PRIu64 " payload bytes\n",
           got, with_header, whole, checked, bad, copied);
    fflush(stdout);
    ml_port_free(in);
    ml_listener_free(l);
    ml_node_free(node);
    return (got == messages && bad == 0) ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *region = (argc > 1 && argv[1][0] != '\0') ? argv[1] : NULL;
    uint32_t messages = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 10) : 1000;
    char mid_svc[64], sink_svc[64];
    snprintf(mid_svc, sizeof mid_svc, "zc-mid-%ld", (long)getpid());
    snprintf(sink_svc, sizeof sink_svc, "zc-sink-%ld", (long)getpid());
    fflush(stdout);

    /* Fork first, join after: a member is one process. */
    int rc = 1;
    for (int k = 1; k >= 0; k--) { /* the sink first: the middle connects to it */
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            goto out;
        }
        if (pid == 0)
            exit(k == 1 ? run_sink(region, sink_svc, messages)
                        : run_middle(region, mid_svc, sink_svc));
        stages[k] = pid;
    }
    rc = run_source(region, mid_svc, messages);
out:
    /* A stage not reaped yet: the source gave up early, so stop it too. */
    for (int k = 0; k < 2; k++) {
        if (stages[k] > 0) {
            kill(stages[k], SIGKILL);
            waitpid(stages[k], NULL, 0);
            rc = 1;
        }
    }
    printf("pipeline: %s\n", rc == 0 ? "ok" : "FAILED");
    return rc;
}
