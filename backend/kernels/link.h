/* The link's read loop (link.c). Its signatures are the ctypes argtypes that
 * backend/kernels/link.py sets: change both together. */
#ifndef BEVY_LINK_H
#define BEVY_LINK_H

#include <stdint.h>

#define LINK_KEY 4       /* a fetch's priority: up to four integers, smallest first */
#define LINK_PARTS 4     /* reads per fetch at most (an expert's gate, up, down) */
#define LINK_MAX_DEPTH 16 /* fetches whose reads are queued at once, at most */
/* A landed fetch as bevy_link_wait writes it: its tag, when its reads were queued and when
 * they had all landed (CLOCK_MONOTONIC, ns), then each read's bytes or -errno. */
#define LINK_DONE_WORDS (3 + LINK_PARTS)

typedef struct bevy_link bevy_link;

/* An AIO context for `depth` fetches' reads; NULL where the kernel refuses one. */
bevy_link *bevy_link_open(int depth);
/* Before start: land each fetch no sooner than a link of `bytes_per_s` would carry it, one
 * fetch after another from when it started (<= 0: as the reads land). For comparing
 * policies on a link of one steady speed; the reads themselves are unchanged. */
void bevy_link_pace(bevy_link *L, int64_t bytes_per_s);
/* Start the loop's thread. 0, or -errno. */
int bevy_link_start(bevy_link *L);
/* Queue a fetch: `key` [LINK_KEY], `reads` [n, 4] (fd, address, length, offset).
 * 0; -1 once closing (or out of memory); -2 for a bad n. Any thread. */
int bevy_link_submit(bevy_link *L, const int64_t *key, int64_t tag, int n, const int64_t *reads);
/* Wait until fetches have landed, bevy_link_wake is called (once since the last wait
 * returned) or `timeout_ns` has passed (0: do not wait; negative: no limit); write up to
 * `max` landed fetches to `out` [max, LINK_DONE_WORDS]. Their number (0: woken or timed
 * out), or -1 once closed with nothing left. */
int bevy_link_wait(bevy_link *L, int64_t *out, int max, int64_t timeout_ns);
/* End a bevy_link_wait now, or the next one at once. Any thread. */
void bevy_link_wake(bevy_link *L);
/* Fetches submitted and not yet started. */
int bevy_link_queued(bevy_link *L);
/* 1 while reads go through AIO; 0 once the loop fell back to pread. */
int bevy_link_batched(bevy_link *L);
/* The loop thread's CPU time so far (ns); -1 before it starts or once it ended. */
int64_t bevy_link_cpu_ns(bevy_link *L);
/* Stop taking fetches, let the queued reads land (reported), end the thread. */
void bevy_link_close(bevy_link *L);
/* Free everything (after close, and after the last bevy_link_wait returned). */
void bevy_link_free(bevy_link *L);

#endif /* BEVY_LINK_H */
