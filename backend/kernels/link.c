/* The link's read loop in C: a thread that queues expert reads in the kernel (Linux native
 * AIO), waits for them and queues the next ones by priority, without Python or the GIL.
 *
 * The engine submits fetches (each a priority, a tag and up to LINK_PARTS reads into its
 * slot); the loop keeps QUEUED experts' reads in the kernel, and as soon as the oldest
 * one's reads have landed it queues the next highest-priority fetch before it reports the
 * landed one. The engine's thread takes the reports between its steps (bevy_link_wait, which
 * also blocks there while it has nothing to run) and does what needs the interpreter: the
 * results' checks, telemetry, the cache's bookkeeping. In Python the loop
 * needed the GIL between a read landing and the next one queued, and while the engine's
 * Python held it the SSD sat idle (docs/performance.md, "The link's loop in C").
 *
 * Should the kernel refuse a queue (io_submit or io_getevents failing), the loop lets every
 * queued read finish (io_destroy waits for them), reads those fetches again with pread and
 * goes on with pread alone: a fetch is never lost, as the Python loop's fallback does.
 * Results per read are bytes read or -errno; short reads are the caller's to complete.
 * Linux only (link.py builds it there alone). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "link.h"

typedef struct {
    int64_t key[LINK_KEY];
    int64_t seq; /* ties go to the first submitted */
    int64_t tag;
    int n;
    int64_t read[LINK_PARTS][4]; /* fd, address, length, offset */
} job_t;

typedef struct {
    job_t job;
    int64_t res[LINK_PARTS];
    int64_t start_ns, order, due_ns;
    int left, used;
} flight_t;

struct bevy_link {
    pthread_mutex_t mu;
    pthread_cond_t work, landed;
    job_t *heap;
    int n_heap, cap_heap;
    int64_t *done; /* LINK_DONE_WORDS per landed fetch, oldest at done_head */
    int n_done, cap_done, done_head;
    flight_t *flights; /* only the loop thread touches these */
    int depth, n_flights;
    int64_t seq, order;
    double ns_per_byte; /* a paced link (bevy_link_pace); 0: the reads' own pace */
    int64_t paced_until; /* when the paced link has carried every fetch started so far */
    int closing, finished, started, aio, inited, woken;
    aio_context_t ctx;
    struct iocb *cbs;
    struct iocb **cbp;
    struct io_event *events;
    pthread_t thread;
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int before(const job_t *a, const job_t *b) {
    for (int i = 0; i < LINK_KEY; i++)
        if (a->key[i] != b->key[i]) return a->key[i] < b->key[i];
    return a->seq < b->seq;
}

static void heap_push(bevy_link *L, const job_t *j) {
    int i = L->n_heap++;
    while (i > 0) {
        int up = (i - 1) / 2;
        if (!before(j, &L->heap[up])) break;
        L->heap[i] = L->heap[up];
        i = up;
    }
    L->heap[i] = *j;
}

static job_t heap_pop(bevy_link *L) {
    job_t top = L->heap[0], last = L->heap[--L->n_heap];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= L->n_heap) break;
        if (c + 1 < L->n_heap && before(&L->heap[c + 1], &L->heap[c])) c++;
        if (!before(&L->heap[c], &last)) break;
        L->heap[i] = L->heap[c];
        i = c;
    }
    if (L->n_heap) L->heap[i] = last;
    return top;
}

/* Append a landed fetch for bevy_link_wait (holding mu). 0, or -1 without memory. */
static int report(bevy_link *L, const job_t *j, const int64_t *res, int64_t start, int64_t end) {
    if (L->n_done == L->cap_done) {
        int cap = L->cap_done ? 2 * L->cap_done : 16;
        int64_t *d = malloc(sizeof(int64_t) * LINK_DONE_WORDS * (size_t)cap);
        if (!d) return -1;
        for (int i = 0; i < L->n_done; i++)
            memcpy(d + (size_t)i * LINK_DONE_WORDS,
                   L->done + (size_t)((L->done_head + i) % L->cap_done) * LINK_DONE_WORDS,
                   sizeof(int64_t) * LINK_DONE_WORDS);
        free(L->done);
        L->done = d;
        L->cap_done = cap;
        L->done_head = 0;
    }
    int64_t *d = L->done + (size_t)((L->done_head + L->n_done) % L->cap_done) * LINK_DONE_WORDS;
    d[0] = j->tag, d[1] = start, d[2] = end;
    for (int p = 0; p < LINK_PARTS; p++) d[3 + p] = p < j->n ? res[p] : 0;
    L->n_done++;
    return 0;
}

static void report_all(bevy_link *L, const job_t *jobs, int64_t (*res)[LINK_PARTS],
                       const int64_t *start, int n) {
    if (!n) return;
    int64_t end = now_ns();
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < n; i++)
        while (report(L, &jobs[i], res[i], start[i], end)) { /* retry: a report is never dropped */
            pthread_mutex_unlock(&L->mu);
            usleep(1000);
            pthread_mutex_lock(&L->mu);
        }
    pthread_cond_broadcast(&L->landed);
    pthread_mutex_unlock(&L->mu);
}

/* When a fetch started at `t` lands on a paced link: one fetch after another, each taking
 * its bytes at the link's rate (no credit for time the link sat idle); 0 unpaced. */
static int64_t paced_due(bevy_link *L, const job_t *j, int64_t t) {
    if (L->ns_per_byte <= 0) return 0;
    int64_t bytes = 0;
    for (int p = 0; p < j->n; p++) bytes += j->read[p][2];
    if (L->paced_until < t) L->paced_until = t;
    L->paced_until += (int64_t)((double)bytes * L->ns_per_byte);
    return L->paced_until;
}

static void sleep_until(int64_t due) {
    if (due <= now_ns()) return;
    struct timespec t = {(time_t)(due / 1000000000), (long)(due % 1000000000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
    }
}

static void read_now(const job_t *j, int64_t *res) {
    for (int p = 0; p < j->n; p++) {
        ssize_t got = pread((int)j->read[p][0], (void *)(uintptr_t)j->read[p][1],
                            (size_t)j->read[p][2], (off_t)j->read[p][3]);
        res[p] = got < 0 ? -(int64_t)errno : (int64_t)got;
    }
}

/* Up to `room` fetches off the heap, highest priority first; none once closing. */
static int take(bevy_link *L, job_t *out, int room) {
    int n = 0;
    pthread_mutex_lock(&L->mu);
    while (n < room && L->n_heap && !L->closing) out[n++] = heap_pop(L);
    pthread_mutex_unlock(&L->mu);
    return n;
}

/* The queue failed: every queued read has finished once io_destroy returns; read each
 * flight again with pread, report it, and use pread from now on. */
static void fall_back(bevy_link *L) {
    syscall(SYS_io_destroy, L->ctx);
    L->ctx = 0, L->aio = 0;
    for (int f = 0; f < L->depth; f++) {
        flight_t *fl = &L->flights[f];
        if (!fl->used) continue;
        read_now(&fl->job, fl->res);
        report_all(L, &fl->job, &fl->res, &fl->start_ns, 1);
        fl->used = 0;
    }
    L->n_flights = 0;
}

/* Queue the fetches' reads in the kernel in one call (or read them now, without AIO). */
static void start(bevy_link *L, job_t *jobs, int n) {
    if (!n) return;
    int64_t t = now_ns();
    if (!L->aio) {
        for (int i = 0; i < n; i++) {
            int64_t res[1][LINK_PARTS], due = paced_due(L, &jobs[i], t);
            read_now(&jobs[i], res[0]);
            sleep_until(due);
            report_all(L, &jobs[i], res, &t, 1);
        }
        return;
    }
    int nr = 0;
    for (int i = 0; i < n; i++) {
        int f = 0;
        while (L->flights[f].used) f++;
        flight_t *fl = &L->flights[f];
        fl->job = jobs[i], fl->used = 1, fl->left = jobs[i].n, fl->start_ns = t;
        fl->due_ns = paced_due(L, &jobs[i], t);
        fl->order = L->order++;
        L->n_flights++;
        for (int p = 0; p < jobs[i].n; p++, nr++) {
            struct iocb *cb = &L->cbs[nr];
            memset(cb, 0, sizeof *cb);
            cb->aio_data = (uint64_t)(f * LINK_PARTS + p);
            cb->aio_lio_opcode = IOCB_CMD_PREAD;
            cb->aio_fildes = (uint32_t)jobs[i].read[p][0];
            cb->aio_buf = (uint64_t)jobs[i].read[p][1];
            cb->aio_nbytes = (uint64_t)jobs[i].read[p][2];
            cb->aio_offset = jobs[i].read[p][3];
            L->cbp[nr] = cb;
        }
    }
    long queued = syscall(SYS_io_submit, L->ctx, (long)nr, L->cbp);
    if (queued != nr) fall_back(L); /* those queued finish in io_destroy */
}

/* Wait for the oldest flight's reads (others landing meanwhile count too); queue the next
 * fetches, then report every flight whose reads have all landed. */
static void land(bevy_link *L) {
    flight_t *oldest = NULL;
    for (int f = 0; f < L->depth; f++)
        if (L->flights[f].used && (!oldest || L->flights[f].order < oldest->order))
            oldest = &L->flights[f];
    long got;
    do
        got = syscall(SYS_io_getevents, L->ctx, (long)oldest->left, (long)(L->depth * LINK_PARTS),
                      L->events, NULL);
    while (got < 0 && errno == EINTR);
    if (got < 0) {
        fall_back(L);
        return;
    }
    job_t jobs[LINK_MAX_DEPTH];
    int64_t res[LINK_MAX_DEPTH][LINK_PARTS], starts[LINK_MAX_DEPTH], due = 0;
    int n = 0;
    for (long i = 0; i < got; i++) {
        uint64_t t = L->events[i].data;
        flight_t *fl = &L->flights[t / LINK_PARTS];
        fl->res[t % LINK_PARTS] = L->events[i].res;
        fl->left--;
    }
    for (int f = 0; f < L->depth; f++) {
        flight_t *fl = &L->flights[f];
        if (!fl->used || fl->left) continue;
        jobs[n] = fl->job, starts[n] = fl->start_ns;
        if (fl->due_ns > due) due = fl->due_ns;
        memcpy(res[n], fl->res, sizeof fl->res);
        n++;
        fl->used = 0;
        L->n_flights--;
    }
    /* The SSD gets the next reads before the landed ones are handed over. */
    job_t next[LINK_MAX_DEPTH];
    start(L, next, take(L, next, L->depth - L->n_flights));
    sleep_until(due); /* on a paced link, not before the link would have carried them */
    report_all(L, jobs, res, starts, n);
}

static void *loop(void *arg) {
    bevy_link *L = arg;
    job_t batch[LINK_MAX_DEPTH];
    for (;;) {
        pthread_mutex_lock(&L->mu);
        while (!L->n_heap && !L->n_flights && !L->closing) pthread_cond_wait(&L->work, &L->mu);
        int stop = L->closing && !L->n_flights;
        pthread_mutex_unlock(&L->mu);
        if (stop) break;
        start(L, batch, take(L, batch, L->depth - L->n_flights));
        if (L->n_flights) land(L);
    }
    pthread_mutex_lock(&L->mu);
    L->finished = 1;
    pthread_cond_broadcast(&L->landed);
    pthread_mutex_unlock(&L->mu);
    return NULL;
}

bevy_link *bevy_link_open(int depth) {
    if (depth < 1 || depth > LINK_MAX_DEPTH) return NULL;
    bevy_link *L = calloc(1, sizeof *L);
    if (!L) return NULL;
    L->depth = depth;
    L->flights = calloc((size_t)depth, sizeof *L->flights);
    L->cbs = calloc((size_t)depth * LINK_PARTS, sizeof *L->cbs);
    L->cbp = calloc((size_t)depth * LINK_PARTS, sizeof *L->cbp);
    L->events = calloc((size_t)depth * LINK_PARTS, sizeof *L->events);
    L->cap_heap = 64;
    L->heap = malloc(sizeof *L->heap * (size_t)L->cap_heap);
    if (!L->flights || !L->cbs || !L->cbp || !L->events || !L->heap ||
        syscall(SYS_io_setup, depth * LINK_PARTS, &L->ctx) < 0) {
        bevy_link_free(L);
        return NULL;
    }
    L->aio = L->inited = 1;
    pthread_mutex_init(&L->mu, NULL);
    pthread_cond_init(&L->work, NULL);
    pthread_condattr_t attr; /* timed waits on CLOCK_MONOTONIC, as the reports' times */
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&L->landed, &attr);
    pthread_condattr_destroy(&attr);
    return L;
}

void bevy_link_pace(bevy_link *L, int64_t bytes_per_s) {
    L->ns_per_byte = bytes_per_s > 0 ? 1e9 / (double)bytes_per_s : 0;
}

int bevy_link_start(bevy_link *L) {
    if (L->started) return 0;
    int rc = pthread_create(&L->thread, NULL, loop, L);
    if (rc) return -rc;
    L->started = 1;
    return 0;
}

int bevy_link_submit(bevy_link *L, const int64_t *key, int64_t tag, int n, const int64_t *reads) {
    if (n < 1 || n > LINK_PARTS) return -2;
    job_t j;
    memcpy(j.key, key, sizeof j.key);
    j.tag = tag, j.n = n;
    memcpy(j.read, reads, sizeof(int64_t) * 4 * (size_t)n);
    int rc = 0;
    pthread_mutex_lock(&L->mu);
    if (L->closing) {
        rc = -1;
    } else {
        if (L->n_heap == L->cap_heap) {
            job_t *h = realloc(L->heap, sizeof *h * (size_t)L->cap_heap * 2);
            if (h) L->heap = h, L->cap_heap *= 2;
        }
        if (L->n_heap < L->cap_heap) {
            j.seq = L->seq++;
            heap_push(L, &j);
            pthread_cond_signal(&L->work);
        } else {
            rc = -1;
        }
    }
    pthread_mutex_unlock(&L->mu);
    return rc;
}

int bevy_link_wait(bevy_link *L, int64_t *out, int max, int64_t timeout_ns) {
    struct timespec until;
    if (timeout_ns > 0) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        int64_t ns = until.tv_nsec + timeout_ns % 1000000000;
        until.tv_sec += (time_t)(timeout_ns / 1000000000 + ns / 1000000000);
        until.tv_nsec = (long)(ns % 1000000000);
    }
    pthread_mutex_lock(&L->mu);
    int timed_out = timeout_ns == 0;
    while (!L->n_done && !L->woken && !timed_out && !(L->finished || (L->closing && !L->started)))
        if (timeout_ns < 0)
            pthread_cond_wait(&L->landed, &L->mu);
        else
            timed_out = pthread_cond_timedwait(&L->landed, &L->mu, &until) == ETIMEDOUT;
    L->woken = 0;
    int n = 0;
    for (; n < max && L->n_done; n++, L->n_done--) {
        memcpy(out + (size_t)n * LINK_DONE_WORDS, L->done + (size_t)L->done_head * LINK_DONE_WORDS,
               sizeof(int64_t) * LINK_DONE_WORDS);
        L->done_head = (L->done_head + 1) % L->cap_done;
    }
    int over = !n && (L->finished || (L->closing && !L->started));
    pthread_mutex_unlock(&L->mu);
    return over ? -1 : n;
}

void bevy_link_wake(bevy_link *L) {
    pthread_mutex_lock(&L->mu);
    L->woken = 1;
    pthread_cond_broadcast(&L->landed);
    pthread_mutex_unlock(&L->mu);
}

int bevy_link_queued(bevy_link *L) {
    pthread_mutex_lock(&L->mu);
    int n = L->n_heap;
    pthread_mutex_unlock(&L->mu);
    return n;
}

int bevy_link_batched(bevy_link *L) { return L->aio; }

int64_t bevy_link_cpu_ns(bevy_link *L) {
    clockid_t id;
    struct timespec t;
    if (!L->started || L->finished || pthread_getcpuclockid(L->thread, &id) ||
        clock_gettime(id, &t))
        return -1;
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void bevy_link_close(bevy_link *L) {
    pthread_mutex_lock(&L->mu);
    L->closing = 1;
    pthread_cond_broadcast(&L->work);
    pthread_cond_broadcast(&L->landed);
    pthread_mutex_unlock(&L->mu);
    if (L->started) {
        pthread_join(L->thread, NULL);
        L->started = 0;
        L->finished = 1;
    }
}

void bevy_link_free(bevy_link *L) {
    if (!L) return;
    if (L->ctx) syscall(SYS_io_destroy, L->ctx);
    if (L->inited) {
        pthread_mutex_destroy(&L->mu);
        pthread_cond_destroy(&L->work);
        pthread_cond_destroy(&L->landed);
    }
    free(L->flights);
    free(L->cbs);
    free(L->cbp);
    free(L->events);
    free(L->heap);
    free(L->done);
    free(L);
}
