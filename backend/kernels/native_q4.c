/* Products with Q4_0 / Q4_1 weights, straight from their blocks, for a few rows (decoding).
 * Built and loaded by backend/kernels/native.py (see there for why and what it measured).
 *
 * A weight [N, K] is N rows of K/32 blocks. Q4_1: f16 d, f16 m, 16 bytes; Q4_0: f16 d,
 * 16 bytes. Byte i holds element i in its low nibble and element i + 16 in its high one.
 * Q4_1 element = d * q + m; Q4_0 element = d * (q - 8). Each output is summed as
 *
 *     Q4_1: y[r, n] = sum_b d[n, b] * (q[n, b, :] . x[r, b, :])  +  sum_b m[n, b] * sum(x[r, b, :])
 *     Q4_0: y[r, n] = sum_b d[n, b] * ((q[n, b, :] - 8) . x[r, b, :])
 *
 * the weights widened to float once per block (q - 8 taken in integers) and each scale
 * applied once per block. Every row of x is reduced on its own, in the same
 * order whatever the other rows are, so a row's result does not depend on its batch-mates.
 * Build with -ffp-contract=off: a scalar multiply-add is then never fused in one place and
 * not another.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the native Q4 kernels need AVX2, FMA and F16C"
#endif

#define ROWS 8 /* rows of x reduced together, each weight block widened once for them */

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#ifdef __AVX512F__
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(acc_t a) { return _mm512_reduce_add_ps(a); }
/* One block of weight row W: its 32 widened weights times each x row, added to ACC. */
#define BLOCK(W, ACC, TAIL)                                                                  \
    {                                                                                        \
        const uint8_t *blk = (W) + (size_t)b * bs;                                           \
        float d = f16_at(blk), c = q4_1 ? f16_at(blk + 2) : 0.f;                             \
        __m128i q = _mm_loadu_si128((const __m128i *)(blk + (q4_1 ? 4 : 2)));                \
        __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low), off);                               \
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), off);            \
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));                            \
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));                            \
        __m512 dv = _mm512_set1_ps(d);                                                       \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (size_t)b * 32;                            \
            __m512 s = _mm512_mul_ps(w0, _mm512_loadu_ps(xb));                               \
            s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), s);                            \
            ACC[r] = _mm512_fmadd_ps(dv, s, ACC[r]);                                         \
            if (q4_1) TAIL[r] += c * xsum[(size_t)r * nb + b];                               \
        }                                                                                    \
    }
#else
typedef __m256 acc_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline float acc_sum(acc_t a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}
#define BLOCK(W, ACC, TAIL)                                                                  \
    {                                                                                        \
        const uint8_t *blk = (W) + (size_t)b * bs;                                           \
        float d = f16_at(blk), c = q4_1 ? f16_at(blk + 2) : 0.f;                             \
        __m128i q = _mm_loadu_si128((const __m128i *)(blk + (q4_1 ? 4 : 2)));                \
        __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low), off);                               \
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), off);            \
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));                            \
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));         \
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));                            \
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));         \
        __m256 dv = _mm256_set1_ps(d);                                                       \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (size_t)b * 32;                            \
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));                               \
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);                             \
            s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);                            \
            s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);                            \
            ACC[r] = _mm256_fmadd_ps(dv, s, ACC[r]);                                         \
            if (q4_1) TAIL[r] += c * xsum[(size_t)r * nb + b];                               \
        }                                                                                    \
    }
#endif

/* y[r, n] for r < m and n0 <= n < n1 (y has row stride ldy), R weight rows at a time.
   Inlined with m, R and the block type as constants, so that the compiler can unroll the
   row loops and keep the m * R accumulators in registers (all of them with AVX-512's 32;
   AVX2's 16 spill some at the larger m * R). Each output's operations are the same
   whatever m, R and n0 are (the same BLOCK, the same order), so its bits do not depend
   on its batch-mates or on how the columns are shared out. */
static inline __attribute__((always_inline)) void cols(const uint8_t *w, const int q4_1,
                                                       const float *x, const float *xsum,
                                                       const int m, const int R, int k,
                                                       float *y, int ldy, int n0, int n1) {
    const int nb = k / 32, bs = q4_1 ? 20 : 18;
    const __m128i low = _mm_set1_epi8(0x0F), off = _mm_set1_epi8(q4_1 ? 0 : 8);
    int n = n0;
    for (; n + R <= n1; n += R) {
        acc_t acc[8][ROWS];
        float tail[8][ROWS];
        for (int i = 0; i < R; i++)
            for (int r = 0; r < m; r++) {
                acc[i][r] = acc_zero();
                tail[i][r] = 0.f;
            }
        const uint8_t *w0 = w + (size_t)n * nb * bs;
        /* The next R weight rows, block by block as these are read: R short streams that
           the hardware prefetcher does not pick up in time (the demo's experts took 11-18 %
           less time for 1-4 rows with this, their bytes out of the CPU cache). A prefetch
           past the weight's end does not fault. */
        const uint8_t *next = w0 + (size_t)R * nb * bs;
        for (int b = 0; b < nb; b++) {
            for (int i = 0; i < R; i++)
                _mm_prefetch((const char *)(next + (size_t)i * nb * bs + (size_t)b * bs), _MM_HINT_T0);
            for (int i = 0; i < R; i++) BLOCK(w0 + (size_t)i * nb * bs, acc[i], tail[i])
        }
        for (int i = 0; i < R; i++)
            for (int r = 0; r < m; r++) y[(size_t)r * ldy + n + i] = acc_sum(acc[i][r]) + tail[i][r];
    }
    for (; n < n1; n++) {
        acc_t acc[ROWS];
        float tail[ROWS];
        for (int r = 0; r < m; r++) {
            acc[r] = acc_zero();
            tail[r] = 0.f;
        }
        const uint8_t *w0 = w + (size_t)n * nb * bs;
        for (int b = 0; b < nb; b++) BLOCK(w0, acc, tail)
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]) + tail[r];
    }
}

/* R by rows of x: m * R <= 16 accumulators, and R dividing 32 (the demo's column chunks:
   fewer columns left to the one-at-a-time loop). The fastest of those tried on AVX-512
   (benchmarks/q4_kernels.py). */
_Static_assert(ROWS == 8, "q4_cols has a case for each row count 1..ROWS");
#define COLS(Q, M, R) cols(w, Q, x, xsum, M, R, k, y, ldy, n0, n1)
#define BY_ROWS(Q)                                                                           \
    switch (m) {                                                                             \
    case 1: COLS(Q, 1, 8); break;                                                            \
    case 2: COLS(Q, 2, 4); break;                                                            \
    case 3: COLS(Q, 3, 4); break;                                                            \
    case 4: COLS(Q, 4, 4); break;                                                            \
    case 5: COLS(Q, 5, 2); break;                                                            \
    case 6: COLS(Q, 6, 2); break;                                                            \
    case 7: COLS(Q, 7, 2); break;                                                            \
    case 8: COLS(Q, 8, 2); break;                                                            \
    default: break; /* no rows (callers pass 1..ROWS) */                                     \
    }

/* y[r, n] for r < m (1 <= m <= ROWS) and n0 <= n < n1; y has row stride ldy. */
static void q4_cols(const uint8_t *w, int q4_1, const float *x, const float *xsum, int m, int k,
                    float *y, int ldy, int n0, int n1) {
    if (q4_1)
        BY_ROWS(1)
    else
        BY_ROWS(0)
}

/* xsum[r, b] = sum of block b of row r (four vectors of 8 added pairwise, then across). */
static void block_sums(const float *x, float *xsum, int m, int k) {
    const int nb = k / 32;
    for (int r = 0; r < m; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * k + (size_t)b * 32;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            xsum[(size_t)r * nb + b] = _mm_cvtss_f32(v);
        }
}

/* Column chunks shared out among the threads: enough for balance, big enough to pair. */
static int n_chunks(int n) { return n < 128 ? 1 : (n < 4096 ? n / 32 : 128); }

/* y [M, N] = x [M, K] @ W.T for W [N, K] in Q4 blocks, on `threads` threads. 0 on success,
   -1 if out of memory. */
int bevy_q4_linear(const uint8_t *w, int q4_1, const float *x, float *y, int M, int N, int K,
                   int threads) {
    const int nb = K / 32, chunks = n_chunks(N);
    float *xsum = malloc(sizeof(float) * (size_t)M * nb + 1);
    if (!xsum) return -1;
    block_sums(x, xsum, M, K);
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        int m = M - r0 < ROWS ? M - r0 : ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int t = 0; t < chunks; t++)
            q4_cols(w, q4_1, x + (size_t)r0 * K, xsum + (size_t)r0 * nb, m, K,
                    y + (size_t)r0 * N, N, (int)((long)N * t / chunks),
                    (int)((long)N * (t + 1) / chunks));
    }
    free(xsum);
    return 0;
}

/* out [M, hidden] = down(silu(gate(x)) * up(x)) for one expert; x [M, hidden]; gate and up
   [inner, hidden], down [hidden, inner]. types: bit 0/1/2 set if gate/up/down is Q4_1.
   On `threads` threads; 0 on success, -1 if out of memory. */
int bevy_q4_expert_mlp(const uint8_t *gate, const uint8_t *up, const uint8_t *down, int types,
                       const float *x, float *out, int M, int inner, int hidden, int threads) {
    const int gq = types & 1, uq = (types >> 1) & 1, dq = (types >> 2) & 1;
    const int nbh = hidden / 32, nbi = inner / 32;
    const int ci = n_chunks(inner), ch = n_chunks(hidden);
    float *h = malloc(sizeof(float) * ((size_t)M * inner * 2 + (size_t)M * (nbh + nbi)) + 1);
    if (!h) return -1;
    float *u = h + (size_t)M * inner, *xsum = u + (size_t)M * inner, *hsum = xsum + (size_t)M * nbh;
    block_sums(x, xsum, M, hidden);
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        int m = M - r0 < ROWS ? M - r0 : ROWS;
        const float *xr = x + (size_t)r0 * hidden, *xs = xsum + (size_t)r0 * nbh;
        float *hr = h + (size_t)r0 * inner, *ur = u + (size_t)r0 * inner;
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int t = 0; t < ci; t++) {
                int n0 = (int)((long)inner * t / ci), n1 = (int)((long)inner * (t + 1) / ci);
                q4_cols(gate, gq, xr, xs, m, hidden, hr, inner, n0, n1);
                q4_cols(up, uq, xr, xs, m, hidden, ur, inner, n0, n1);
                for (int r = 0; r < m; r++)
                    for (int n = n0; n < n1; n++) {
                        float g = hr[(size_t)r * inner + n];
                        hr[(size_t)r * inner + n] = g / (1.f + expf(-g)) * ur[(size_t)r * inner + n];
                    }
            }
#pragma omp single
            block_sums(hr, hsum + (size_t)r0 * nbi, m, inner);
            /* (the implicit barrier after single: every thread sees all of hsum) */
#pragma omp for schedule(static)
            for (int t = 0; t < ch; t++)
                q4_cols(down, dq, hr, hsum + (size_t)r0 * nbi, m, inner, out + (size_t)r0 * hidden,
                        hidden, (int)((long)hidden * t / ch), (int)((long)hidden * (t + 1) / ch));
        }
    }
    free(h);
    return 0;
}

/* route_w[i] * o (rounded to float, as torch's product is) added to y's row i / k if it is
   below sum_rows, else written to parts[j]: one route's product, in the caller's order. */
static void moe_route(int j, int i, int k, const float *route_w, const float *o, float *y,
                      float *parts, int sum_rows, int hidden) {
    const float w = route_w[i];
    const int row = i / k;
    if (row < sum_rows) {
        float *yr = y + (size_t)row * hidden;
        for (int c = 0; c < hidden; c++) {
            const float p = w * o[c];
            yr[c] += p;
        }
    } else {
        float *pr = parts + (size_t)j * hidden;
        for (int c = 0; c < hidden; c++) pr[c] = w * o[c];
    }
}

/* Expert e of a bevy_q4_moe call on its gathered rows (xg) into og, on `threads` threads. */
static int moe_expert(const uint64_t *weights, const int *types, const int *counts,
                      const int *first, int e, const float *xg, float *og, int inner, int hidden,
                      int threads) {
    const size_t at = (size_t)first[e] * hidden;
    return bevy_q4_expert_mlp((const uint8_t *)weights[3 * e], (const uint8_t *)weights[3 * e + 1],
                              (const uint8_t *)weights[3 * e + 2], types[e], xg + at, og + at,
                              counts[e], inner, hidden, threads);
}

/* A whole MoE layer for a batch of rows, in one call (no Python between experts).
   For each expert e < n_experts in turn, and each of its counts[e] routes in turn (taken
   from `routes`, consecutively over the experts, route j overall): i = routes[j] is the
   route's index in the [R, k] routing, so x[i / k] is its row and route_w[i] its weight,
   and p = route_w[i] * mlp_e(x[i / k]) is added to y[i / k] if i / k < sum_rows (y
   [sum_rows, hidden], zeroed by the caller), else written to parts[j] (parts [n_routes,
   hidden]). The products and sums are those of running each expert alone, scaling its
   outputs, then adding them in this order (as the engine's index_add_ path does): the
   same bits. weights: gate, up, down addresses of each expert (3 per expert); types as
   above, one per expert. On `threads` threads; 0 on success, -1 if out of memory.

   With at least two experts per thread, the threads take whole experts, one at a time as
   each finishes (one parallel region for the call; a thread that the OS or the link
   thread holds up takes fewer experts instead of stalling the others at every barrier);
   the products are then added in order. With fewer, each expert's columns are shared. */
int bevy_q4_moe(const uint64_t *weights, const int *types, const int *counts, int n_experts,
                const int *routes, const float *route_w, int k, const float *x, float *y,
                float *parts, int sum_rows, int inner, int hidden, int threads) {
    int n_routes = 0;
    for (int e = 0; e < n_experts; e++) n_routes += counts[e];
    /* Every route's input row gathered (xg) and its expert's output (og), route j at row j. */
    float *xg = malloc(sizeof(float) * (size_t)n_routes * hidden * 2 + 1);
    int *first = malloc(sizeof(int) * (size_t)n_experts + 1);
    if (!xg || !first) {
        free(xg);
        free(first);
        return -1;
    }
    float *og = xg + (size_t)n_routes * hidden;
    for (int e = 0, j0 = 0; e < n_experts; j0 += counts[e], e++) first[e] = j0;
    for (int j = 0; j < n_routes; j++)
        memcpy(xg + (size_t)j * hidden, x + (size_t)(routes[j] / k) * hidden, sizeof(float) * hidden);
    int failed = 0;
    if (threads > 1 && n_experts >= 2 * threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
        for (int e = 0; e < n_experts; e++)
            failed |= moe_expert(weights, types, counts, first, e, xg, og, inner, hidden, 1);
    } else {
        for (int e = 0; e < n_experts && !failed; e++)
            failed |= moe_expert(weights, types, counts, first, e, xg, og, inner, hidden, threads);
    }
    if (!failed)
        for (int j = 0; j < n_routes; j++)
            moe_route(j, routes[j], k, route_w, og + (size_t)j * hidden, y, parts, sum_rows, hidden);
    free(xg);
    free(first);
    return failed ? -1 : 0;
}

/* Q8_0 weights (the LM head of most GGUF files): a block is f16 d and 32 int8 q, element
   = d * q. Each output is summed as y[r, n] = sum_b d[n, b] * (q[n, b, :] . x[r, b, :]),
   the weights widened to float once per block for all rows of x, each row reduced on its
   own in the same order whatever the other rows are. The head is wide (49152 rows for
   SmolLM2) and read once per decoding step for a few rows: this reads its 34-byte blocks
   instead of the 128 bytes of their float copy. */
#ifdef __AVX512F__
#define Q8_BLOCK(W, ACC)                                                                     \
    {                                                                                        \
        const uint8_t *blk = (W) + (size_t)b * 34;                                           \
        __m512 dv = _mm512_set1_ps(f16_at(blk));                                             \
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))); \
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))); \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (size_t)b * 32;                            \
            __m512 s = _mm512_mul_ps(w0, _mm512_loadu_ps(xb));                               \
            s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), s);                            \
            ACC[r] = _mm512_fmadd_ps(dv, s, ACC[r]);                                         \
        }                                                                                    \
    }
#else
#define Q8_BLOCK(W, ACC)                                                                     \
    {                                                                                        \
        const uint8_t *blk = (W) + (size_t)b * 34;                                           \
        __m256 dv = _mm256_set1_ps(f16_at(blk));                                             \
        __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));                            \
        __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));                           \
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0));                            \
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)));         \
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1));                            \
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)));         \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (size_t)b * 32;                            \
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));                               \
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);                             \
            s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);                            \
            s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);                            \
            ACC[r] = _mm256_fmadd_ps(dv, s, ACC[r]);                                         \
        }                                                                                    \
    }
#endif

/* y[r, n] for r < m (1 <= m <= ROWS) and n0 <= n < n1 (y has row stride ldy), Q8_0. */
static void q8_cols(const uint8_t *w, const float *x, int m, int k, float *y, int ldy, int n0,
                    int n1) {
    const int nb = k / 32;
    for (int n = n0; n < n1; n++) {
        acc_t acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = acc_zero();
        const uint8_t *w0 = w + (size_t)n * nb * 34;
        for (int b = 0; b < nb; b++) {
            _mm_prefetch((const char *)(w0 + (size_t)(nb + b) * 34), _MM_HINT_T0); /* next row's (see cols) */
            Q8_BLOCK(w0, acc)
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]);
    }
}

/* y [M, N] = x [M, K] @ W.T for W [N, K] in Q8_0 blocks, on `threads` threads. 0. */
int bevy_q8_linear(const uint8_t *w, const float *x, float *y, int M, int N, int K, int threads) {
    const int chunks = n_chunks(N);
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        int m = M - r0 < ROWS ? M - r0 : ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int t = 0; t < chunks; t++)
            q8_cols(w, x + (size_t)r0 * K, m, K, y + (size_t)r0 * N, N,
                    (int)((long)N * t / chunks), (int)((long)N * (t + 1) / chunks));
    }
    return 0;
}

/* ---- Decoding attention: one new token per sequence, float32 KV cache ----------------- */

/* Positions per work item. Fixed, so a row's result depends neither on the number of
   threads nor on its batch-mates: each item's partial softmax is merged in position order. */
#define ATT_CHUNK 256
#define ATT_MAX_REP 16 /* query heads per kv head the kernel takes (callers check) */

#ifdef __AVX512F__
#define VW 16
#define v_load _mm512_loadu_ps
#define v_set1 _mm512_set1_ps
#define v_fmadd _mm512_fmadd_ps
#define v_fnmadd _mm512_fnmadd_ps
#define v_mul _mm512_mul_ps
#define v_add _mm512_add_ps
#define v_max _mm512_max_ps
#define v_store _mm512_storeu_ps
/* 2^n for whole-valued n in [-126, 127] */
static inline acc_t v_pow2(acc_t n) {
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
}
static inline float acc_max(acc_t a) { return _mm512_reduce_max_ps(a); }
static inline acc_t v_round(acc_t x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
#define VW 8
#define v_load _mm256_loadu_ps
#define v_set1 _mm256_set1_ps
#define v_fmadd _mm256_fmadd_ps
#define v_fnmadd _mm256_fnmadd_ps
#define v_mul _mm256_mul_ps
#define v_add _mm256_add_ps
#define v_max _mm256_max_ps
#define v_store _mm256_storeu_ps
static inline acc_t v_pow2(acc_t n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
static inline float acc_max(acc_t a) {
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}
static inline acc_t v_round(acc_t x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

/* exp(x) lane by lane for x <= 0 (softmax's shifted scores): x = n ln 2 + r, |r| <= ln 2 / 2,
   exp(r) by the degree-7 polynomial of Cephes' expf (within ~2 ulp of expf), times 2^n.
   Below -87 it gives exp(-87) (~1.6e-38) instead of a denormal or zero. */
static inline acc_t v_exp(acc_t x) {
    x = v_max(x, v_set1(-87.f));
    acc_t n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    acc_t r = v_fnmadd(n, v_set1(0.693359375f), x);
    r = v_fnmadd(n, v_set1(-2.12194440e-4f), r);
    acc_t p = v_set1(1.9875691500e-4f);
    p = v_fmadd(p, r, v_set1(1.3981999507e-3f));
    p = v_fmadd(p, r, v_set1(8.3334519073e-3f));
    p = v_fmadd(p, r, v_set1(4.1665795894e-2f));
    p = v_fmadd(p, r, v_set1(1.6666665459e-1f));
    p = v_fmadd(p, r, v_set1(5.0000001201e-1f));
    p = v_fmadd(p, v_mul(r, r), v_add(r, v_set1(1.f)));
    return v_mul(p, v_pow2(n));
}

/* One work item: the `rep` query heads q [rep, dh] of one kv head against its keys and
   values K, V [*, dh] at positions j0 <= j < j1. Writes, per head i, the chunk's score
   maximum m, sum l of exp(score - m) and acc [dh] = sum of exp(score - m) * v, to
   out + i * (dh + 2) as (acc, m, l). Inlined with dh a constant (64, 128) so that a head's
   dh / VW accumulators stay in registers. */
static inline __attribute__((always_inline)) void attn_chunk_dh(const float *q, int rep,
                                                                const int dh, const float *K,
                                                                const float *V, int j0, int j1,
                                                                float scale, float *out) {
    float s[ATT_MAX_REP][ATT_CHUNK + VW];
    const int n = j1 - j0, npad = (n + VW - 1) / VW * VW, nv = dh / VW;
    for (int i = 0; i < rep; i++) {
        const float *qi = q + (size_t)i * dh;
        acc_t qv[256 / VW];
        for (int d = 0; d < nv; d++) qv[d] = v_load(qi + d * VW);
        for (int j = 0; j < n; j++) {
            const float *kj = K + (size_t)(j0 + j) * dh;
            acc_t a = v_mul(qv[0], v_load(kj)), b = acc_zero();
            if (nv > 1) b = v_mul(qv[1], v_load(kj + VW));
            for (int d = 2; d < nv; d += 2) {
                a = v_fmadd(qv[d], v_load(kj + d * VW), a);
                if (d + 1 < nv) b = v_fmadd(qv[d + 1], v_load(kj + (d + 1) * VW), b);
            }
            s[i][j] = acc_sum(v_add(a, b)) * scale;
        }
    }
    for (int i = 0; i < rep; i++) {
        float *o = out + (size_t)i * (dh + 2);
        for (int j = n; j < npad; j++) s[i][j] = -INFINITY; /* lanes past the chunk */
        acc_t mv = v_load(&s[i][0]);
        for (int j = VW; j < npad; j += VW) mv = v_max(mv, v_load(&s[i][j]));
        const float m = acc_max(mv);
        acc_t lv = acc_zero();
        for (int j = 0; j < npad; j += VW) {
            acc_t e = v_exp(v_add(v_load(&s[i][j]), v_set1(-m)));
            v_store(&s[i][j], e);
            if (j + VW <= n) lv = v_add(lv, e);
        }
        float l = acc_sum(lv);
        for (int j = n / VW * VW; j < n; j++) l += s[i][j];
        acc_t acc[256 / VW];
        for (int d = 0; d < nv; d++) acc[d] = acc_zero();
        for (int j = 0; j < n; j++) {
            const float *vj = V + (size_t)(j0 + j) * dh;
            acc_t p = v_set1(s[i][j]);
            for (int d = 0; d < nv; d++) acc[d] = v_fmadd(p, v_load(vj + d * VW), acc[d]);
        }
        for (int d = 0; d < nv; d++) v_store(o + d * VW, acc[d]);
        o[dh] = m;
        o[dh + 1] = l;
    }
}

static void attn_chunk(const float *q, int rep, int dh, const float *K, const float *V, int j0,
                       int j1, float scale, float *out) {
    switch (dh) {
    case 64: attn_chunk_dh(q, rep, 64, K, V, j0, j1, scale, out); break;
    case 128: attn_chunk_dh(q, rep, 128, K, V, j0, j1, scale, out); break;
    default: attn_chunk_dh(q, rep, dh, K, V, j0, j1, scale, out); break; /* dh <= 256 */
    }
}

/* Attention of T sequences' new tokens (one each), heads grouped over G kv heads (H / G
   query heads each, at most ATT_MAX_REP; dh a multiple of 16 up to 256).

   Row r: queries q + r * ldq [H, dh] (RoPE applied), its new key and value
   k + r * ldk, v + r * ldv [G, dh], its cache kbuf[r], vbuf[r] [G, caps[r], dh] (float32,
   capacity caps[r] > pos[r]). The new key and value are written at position pos[r], then
   out [T, H * dh] = softmax(q . K[0..pos] * scale) V per head. Work items are (row, kv
   head, chunk of ATT_CHUNK positions), merged per head in position order. On `threads`
   threads; 0 on success, -1 if out of memory, -2 for head counts or widths it does not take. */
int bevy_attn_decode(const float *q, int ldq, const float *k, int ldk, const float *v, int ldv,
                     const uint64_t *kbuf, const uint64_t *vbuf, const int *caps, const int *pos,
                     int T, int H, int G, int dh, float scale, float *out, int threads) {
    if (G <= 0 || H % G || H / G > ATT_MAX_REP || dh % 16 || dh > 256) return -2;
    const int rep = H / G;
    int *first = malloc(sizeof(int) * (size_t)(T + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int r = 0; r < T; r++) first[r + 1] = first[r] + G * ((pos[r] + ATT_CHUNK) / ATT_CHUNK);
    const int items = first[T];
    float *part = malloc(sizeof(float) * (size_t)items * rep * (dh + 2) + 1);
    if (!part) {
        free(first);
        return -1;
    }
    for (int r = 0; r < T; r++)
        for (int g = 0; g < G; g++) {
            size_t at = ((size_t)g * caps[r] + pos[r]) * dh;
            memcpy((float *)kbuf[r] + at, k + (size_t)r * ldk + (size_t)g * dh, sizeof(float) * dh);
            memcpy((float *)vbuf[r] + at, v + (size_t)r * ldv + (size_t)g * dh, sizeof(float) * dh);
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int it = 0; it < items; it++) {
        int r = 0;
        while (first[r + 1] <= it) r++;
        const int nch = (pos[r] + ATT_CHUNK) / ATT_CHUNK, g = (it - first[r]) / nch;
        const int c = (it - first[r]) % nch, len = pos[r] + 1;
        const int j0 = c * ATT_CHUNK, j1 = j0 + ATT_CHUNK < len ? j0 + ATT_CHUNK : len;
        const size_t base = (size_t)g * caps[r] * dh;
        attn_chunk(q + (size_t)r * ldq + (size_t)g * rep * dh, rep, dh, (const float *)kbuf[r] + base,
                   (const float *)vbuf[r] + base, j0, j1, scale, part + (size_t)it * rep * (dh + 2));
    }
    for (int r = 0; r < T; r++) {
        const int nch = (pos[r] + ATT_CHUNK) / ATT_CHUNK;
        for (int h = 0; h < H; h++) {
            const int g = h / rep, i = h % rep;
            const float *p0 = part + ((size_t)(first[r] + g * nch) * rep + i) * (dh + 2);
            const size_t step = (size_t)rep * (dh + 2);
            float m = p0[dh], l = 0.f, *o = out + ((size_t)r * H + h) * dh;
            for (int c = 1; c < nch; c++) m = p0[c * step + dh] > m ? p0[c * step + dh] : m;
            for (int d = 0; d < dh; d++) o[d] = 0.f;
            for (int c = 0; c < nch; c++) {
                const float *pc = p0 + c * step, f = expf(pc[dh] - m);
                l += pc[dh + 1] * f;
                for (int d = 0; d < dh; d++) o[d] += pc[d] * f;
            }
            for (int d = 0; d < dh; d++) o[d] /= l;
        }
    }
    free(part);
    free(first);
    return 0;
}

/* y [M, N] = x [M, K] @ W.T for W in blocks of `qtype` (0: Q4_0, 1: Q4_1, 2: Q8_0). */
static int linear_any(const uint8_t *w, int qtype, const float *x, float *y, int M, int N, int K,
                      int threads) {
    if (qtype == 2) return bevy_q8_linear(w, x, y, M, N, K, threads);
    return bevy_q4_linear(w, qtype, x, y, M, N, K, threads);
}

/* Rotate heads x [nh, dh] by the angles cos, sin [dh / 2] of one position: adjacent pairs
   (x[2i], x[2i+1]) if interleaved (GGUF llama), else halves (x[i], x[i + dh/2]). Each
   value is x1 * c - x2 * s and x2 * c + x1 * s, rounded as torch's ops round them. */
static void rope_heads(float *x, int nh, int dh, const float *cos, const float *sin,
                       int interleaved) {
    const int half = dh / 2;
    for (int hh = 0; hh < nh; hh++) {
        float *xh = x + (size_t)hh * dh;
        for (int i = 0; i < half; i++) {
            const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
            const float x1 = xh[a], x2 = xh[b], c = cos[i], sn = sin[i];
            const float p1 = x1 * c, p2 = x2 * sn, p3 = x2 * c, p4 = x1 * sn;
            xh[a] = p1 - p2;
            xh[b] = p3 + p4;
        }
    }
}

/* A row's routing from its router logits lg [E], 1 <= k <= E: the k largest (largest
   first; of equal ones, the lower expert), and their weights, softmax over all E (exp of
   each logit less the largest, over the sum of those), divided by the k weights' sum if
   norm. */
static void route_top_k(const float *lg, int E, int k, int norm, int64_t *ids, float *w) {
    float m = lg[0], sum = 0.f, top = 0.f;
    for (int e = 1; e < E; e++) m = lg[e] > m ? lg[e] : m;
    for (int e = 0; e < E; e++) sum += expf(lg[e] - m);
    int n = 0;
    for (int e = 0; e < E; e++) {
        if (n == k && !(lg[e] > lg[ids[k - 1]])) continue;
        int j = n < k ? n++ : k - 1; /* a full list drops its last */
        for (; j > 0 && lg[e] > lg[ids[j - 1]]; j--) ids[j] = ids[j - 1];
        ids[j] = e;
    }
    for (int j = 0; j < k; j++) {
        w[j] = expf(lg[ids[j]] - m) / sum;
        top += w[j];
    }
    if (norm)
        for (int j = 0; j < k; j++) w[j] /= top;
}

/* x [D] = rms_norm(h [D]) * w: h * (1 / sqrt(mean(h^2) + eps)), then times w. */
static void rms_row(const float *h, const float *w, float eps, int D, float *x) {
    float ss = 0.f;
    for (int i = 0; i < D; i++) ss += h[i] * h[i];
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (int i = 0; i < D; i++) x[i] = w[i] * (h[i] * inv);
}

/* A decoding step's attention block for T sequences with one new token each:
   out [T, D] = h + attn(rms_norm(h) * norm_w) @ Wo.T, where q, k, v = x @ Wqkv.T (q, k, v
   stacked: [(H + 2G) * dh, D]), q and k rotated at position pos[r] (cos, sin: tables
   [*, dh / 2] by position), the new key and value written to the row's cache, and the
   attention as in bevy_attn_decode. Weights in blocks of qkv_type / o_type (linear_any).
   Then, if ffn_w is given, the MoE's input xout [T, D] = rms_norm(out) * ffn_w, and if
   router [E, D] (float32, D a multiple of 16) is given too, its logits [T, E] = xout @
   router.T, each a dot product in a fixed order; and if ids is given too, each row's
   routing (route_top_k: k experts, norm_topk, into ids [T, k] and weights [T, k]). 0 on
   success, -1 if out of memory, -2 as bevy_attn_decode. */
int bevy_attn_block(const float *h, int T, int D, const float *norm_w, float eps,
                    const uint8_t *wqkv, int qkv_type, const uint8_t *wo, int o_type,
                    const float *cos, const float *sin, int interleaved, const uint64_t *kbuf,
                    const uint64_t *vbuf, const int *caps, const int *pos, int H, int G, int dh,
                    float scale, float *out, const float *ffn_w, float *xout, const float *router,
                    int E, float *logits, int k, int norm_topk, int64_t *ids, float *weights,
                    int threads) {
    const int width = (H + 2 * G) * dh, half = dh / 2;
    if (ids && (!ffn_w || !router || k < 1 || k > E)) return -2;
    float *x = malloc(sizeof(float) * ((size_t)T * D + (size_t)T * width + (size_t)T * H * dh) + 1);
    if (!x) return -1;
    float *qkv = x + (size_t)T * D, *att = qkv + (size_t)T * width;
    for (int r = 0; r < T; r++) rms_row(h + (size_t)r * D, norm_w, eps, D, x + (size_t)r * D);
    int rc = linear_any(wqkv, qkv_type, x, qkv, T, width, D, threads);
    for (int r = 0; r < T && !rc; r++)
        rope_heads(qkv + (size_t)r * width, H + G, dh, cos + (size_t)pos[r] * half,
                   sin + (size_t)pos[r] * half, interleaved);
    if (!rc)
        rc = bevy_attn_decode(qkv, width, qkv + (size_t)H * dh, width, qkv + (size_t)(H + G) * dh,
                              width, kbuf, vbuf, caps, pos, T, H, G, dh, scale, att, threads);
    if (!rc) rc = linear_any(wo, o_type, att, out, T, D, H * dh, threads);
    if (!rc)
        for (size_t i = 0; i < (size_t)T * D; i++) out[i] = h[i] + out[i];
    if (!rc && ffn_w)
        for (int r = 0; r < T; r++) {
            float *xr = xout + (size_t)r * D;
            rms_row(out + (size_t)r * D, ffn_w, eps, D, xr);
            for (int e = 0; router && e < E; e++) {
                const float *we = router + (size_t)e * D;
                acc_t a = acc_zero();
                for (int i = 0; i < D; i += VW) a = v_fmadd(v_load(xr + i), v_load(we + i), a);
                logits[(size_t)r * E + e] = acc_sum(a);
            }
            if (router && ids)
                route_top_k(logits + (size_t)r * E, E, k, norm_topk, ids + (size_t)r * k,
                            weights + (size_t)r * k);
        }
    free(x);
    return rc;
}
