/* The kernels' own threads: a loop's items handed out in chunks to the calling thread and to
 * workers that wait for work by spinning for a while (kvc_pool_spin), then sleeping on a futex.
 *
 * Why not OpenMP's: under the passive wait policy the package needs (spinning threads slow a
 * server down badly beside a busy process) every parallel region waits for a sleeping thread to
 * wake, at every kernel call of a decode step, and libgomp fixes its spin once, when it loads.
 * Here the spin is set per step (the engine spins for decode steps on an uncontended machine,
 * not for prefill), and the caller never waits for a worker to wake: it takes chunks itself from
 * the first, and a worker that wakes late finds what is left, or nothing. Each item is computed
 * by the same operations whichever thread takes it, so results do not depend on the threads.
 *
 * One loop runs at a time; a call from another thread meanwhile (or from inside a loop) runs
 * its loop alone on its own thread. A forked child starts with no workers. */
#include "kvc.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Each group on its own cache line: the spinning workers read the first, every chunk taken
 * writes the second, and neither should move the other's line between cores. */
static _Alignas(64) struct {
    _Atomic uint32_t generation;                           /* a new loop: the workers' futex word */
    _Atomic int open;                                      /* the current loop takes workers */
    _Atomic int inside;                                    /* workers looking at or running the loop */
    _Atomic int sleepers;                                  /* workers on the futex */
    _Atomic int64_t spin_ns;
    pool_body body; void *ctx; int64_t n, chunk; int threads;  /* the loop, written before it opens */
} loop;
static _Alignas(64) _Atomic int64_t next_item;
static _Alignas(64) _Atomic int64_t counts[3];             /* loops shared, loops a worker joined, sleeps */
static _Alignas(64) pthread_mutex_t submit = PTHREAD_MUTEX_INITIALIZER;  /* held by the thread running a loop */
static int workers;                                        /* started, under submit */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void take_chunks(int thread) {
    const pool_body body = loop.body;
    void *ctx = loop.ctx;
    const int64_t n = loop.n, chunk = loop.chunk;
    for (;;) {
        const int64_t i = atomic_fetch_add(&next_item, chunk);
        if (i >= n) return;
        body(ctx, i, i + chunk < n ? i + chunk : n, thread);
    }
}

static void *worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint32_t seen = 0;
    int wanted = 1;  /* whether the last open loop this worker saw took it: only then does it spin */
    for (;;) {
        uint32_t g = atomic_load(&loop.generation);
        if (g == seen) {
            const int64_t budget = wanted ? atomic_load_explicit(&loop.spin_ns, memory_order_relaxed) : 0;
            if (budget > 0) {
                const int64_t until = now_ns() + budget;
                for (int i = 1; (g = atomic_load_explicit(&loop.generation, memory_order_acquire)) == seen; i++) {
                    _mm_pause();
                    if (!(i & 255) && now_ns() > until) break;
                }
            }
            if (g == seen) {
                atomic_fetch_add(&loop.sleepers, 1);
                atomic_fetch_add_explicit(&counts[2], 1, memory_order_relaxed);
                syscall(SYS_futex, &loop.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&loop.sleepers, 1);
                continue;
            }
        }
        seen = g;
        /* The loop is read only while open; the caller closes it and waits for `inside` to
         * empty before it returns or changes it (both sides sequentially consistent). */
        atomic_fetch_add(&loop.inside, 1);
        if (atomic_load(&loop.open)) {
            seen = atomic_load(&loop.generation);
            wanted = me < loop.threads;  /* a loop on fewer threads: this one sleeps, not spins */
            if (wanted) {
                atomic_fetch_add_explicit(&counts[1], 1, memory_order_relaxed);
                take_chunks(me);
            }
        }
        atomic_fetch_sub(&loop.inside, 1);
    }
    return NULL;
}

static void forked_child(void) {
    pthread_mutex_init(&submit, NULL);
    workers = 0;
    atomic_store(&loop.open, 0);
    atomic_store(&loop.inside, 0);
    atomic_store(&loop.sleepers, 0);
}

static void start_workers(int wanted) {
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, forked_child);
    while (workers < wanted && workers < POOL_THREADS - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers++;
    }
}

void pool_for(int threads, int64_t n, int64_t chunk, pool_body body, void *ctx) {
    if (chunk < 1) chunk = 1;
    if (threads <= 1 || n <= chunk || pthread_mutex_trylock(&submit) != 0) {
        if (n > 0) body(ctx, 0, n, 0);
        return;
    }
    start_workers(threads - 1);
    if (workers == 0) {
        pthread_mutex_unlock(&submit);
        body(ctx, 0, n, 0);
        return;
    }
    loop.body = body;
    loop.ctx = ctx;
    loop.n = n;
    loop.chunk = chunk;
    loop.threads = threads;
    atomic_store(&next_item, 0);
    atomic_store(&loop.open, 1);
    atomic_fetch_add(&loop.generation, 1);
    atomic_fetch_add_explicit(&counts[0], 1, memory_order_relaxed);
    if (atomic_load(&loop.sleepers) > 0)
        syscall(SYS_futex, &loop.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    take_chunks(0);
    /* every chunk taken: close the loop, then wait for the workers' last chunks (a worker
     * descheduled inside one gets the CPU back by a yield) */
    atomic_store(&loop.open, 0);
    for (int i = 1; atomic_load(&loop.inside) > 0; i++) {
        if (i & 1023) _mm_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&submit);
}

/* How long (µs) a worker spins for the next loop before it sleeps: 0 sleeps at once. */
void kvc_pool_spin(int64_t microseconds) {
    atomic_store(&loop.spin_ns, microseconds > 0 ? microseconds * 1000 : 0);
}

/* out[0..2]: loops shared with workers, loops a worker joined, times a worker went to sleep. */
void kvc_pool_counts(int64_t *out) {
    for (int i = 0; i < 3; i++) out[i] = atomic_load(&counts[i]);
}

/* Per thread, memory kept for its next call and freed with the thread: a worker's B tiles for its
 * AMX pairs, a caller's packed tiles of activations, a linear's quantized activations, an
 * attention task's scores and tiles. */
static pthread_key_t kept_keys[KEPT_SLOTS];
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;
static __thread struct { void *p; int64_t room; } kept[KEPT_SLOTS];

static void make_kept_keys(void) {
    for (int i = 0; i < KEPT_SLOTS; i++) pthread_key_create(&kept_keys[i], free);
}

void *thread_kept(int slot, int64_t bytes) {
    if (bytes > kept[slot].room) {
        pthread_once(&kept_once, make_kept_keys);
        free(kept[slot].p);
        kept[slot].p = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        kept[slot].room = kept[slot].p ? bytes : 0;
        pthread_setspecific(kept_keys[slot], kept[slot].p);
    }
    return kept[slot].p;
}
