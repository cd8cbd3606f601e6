/* Products with Q4_0 / Q4_1 / Q5_0 / Q3_K / Q4_K / Q5_K / Q6_K / Q8_0 / IQ4_XS weights,
 * straight from their blocks, for a few rows (decoding).
 * Compiled with attention.c into one library by backend/kernels/native.py (see there for
 * why; docs/performance.md for what was measured).
 *
 * A weight [N, K] is N rows of K/32 blocks. Q4_1: f16 d, f16 m, 16 bytes; Q4_0: f16 d,
 * 16 bytes. Byte i holds element i in its low nibble and element i + 16 in its high one.
 * Q4_1 element = d * q + m; Q4_0 element = d * (q - 8). Each output is summed as
 *
 *     Q4_1: y[r, n] = sum_b d[n, b] * (q[n, b, :] . x[r, b, :])  +  sum_b m[n, b] * sum(x[r, b, :])
 *     Q4_0: y[r, n] = sum_b d[n, b] * ((q[n, b, :] - 8) . x[r, b, :])
 *
 * the weights widened to float once per block (AVX-512 looks each nibble's float up in a
 * table, AVX2 converts it; q - 8 is exact either way) and each scale
 * applied once per block. Every row of x is reduced on its own, in the same
 * order whatever the other rows are, so a row's result does not depend on its batch-mates.
 * Experts' Q4_0 / Q4_1 parts (bevy_q4_expert_mlp) multiply in integers instead, x rounded
 * to 8 bits per block of 32 (x8_round), as ggml's CPU kernels do: packed by 16 rows
 * (bevy_q4_pack, q4p_cols) or as stored (q4x_cols), to the same bits.
 * Build with -ffp-contract=off: a scalar multiply-add is then never fused in one place and
 * not another.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Bytes ahead of the packed kernels' reading place that they ask the CPU to bring in: a
   packed weight is one run of bytes, but the hardware prefetcher, which stops at each 4 KiB
   page and restarts with every new stream (gate, up, down in turn, each thread's share of
   the columns), leaves a cold expert's product well short of the memory's pace
   (docs/performance.md). Past the weight's end the prefetch does not fault. */
#define PF_AHEAD 2048
#define ROWS 8 /* rows of x reduced together, each weight block widened once for them */
/* q4_cols' type codes of Q4_0 / Q4_1 packed by 16 rows (bevy_q4_pack); 0-8 are the blocks
   as stored, listed at q4_cols. */
#define T_Q40_PACKED 9
#define T_Q41_PACKED 10
static inline int is_packed(int type) { return type == T_Q40_PACKED || type == T_Q41_PACKED; }
/* Q4_0 / Q4_1 as stored, multiplied as the packed codes are (x rounded to 8 bits,
   q4x_cols): what the expert kernels make of 0 and 1 (x8_code). */
#define T_Q40_X8 11
#define T_Q41_X8 12
static inline int reads_x8(int type) { return is_packed(type) || type == T_Q40_X8 || type == T_Q41_X8; }
static inline int x8_code(int type) { return type == 0 ? T_Q40_X8 : type == 1 ? T_Q41_X8 : type; }

#ifdef __AVX512F__
/* One block of weight row W: its 32 widened weights times each x row, added to ACC. */
#define BLOCK(W, ACC, TAIL)                                                                  \
    {                                                                                        \
        const uint8_t *blk = (W) + (size_t)b * bs;                                           \
        float d = f16_at(blk), c = q4_1 ? f16_at(blk + 2) : 0.f;                             \
        __m128i qb = _mm_loadu_si128((const __m128i *)(blk + (q4_1 ? 4 : 2)));               \
        __m512i q = _mm512_cvtepu8_epi32(qb);                                                \
        __m512 w0 = _mm512_permutexvar_ps(q, nib);                                           \
        __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), nib);                     \
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
#ifdef __AVX512F__
    /* Each nibble's weight (q, or q - 8 for Q4_0) as a float, looked up by the nibble: the
       permute reads only an index's low four bits, so a whole byte widened once gives the
       low nibble's weight and, shifted, the high one's. The same values as widening and
       converting each nibble, in fewer instructions. */
    const __m512 nib = _mm512_sub_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_ps(q4_1 ? 0.f : 8.f));
#else
    const __m128i low = _mm_set1_epi8(0x0F), off = _mm_set1_epi8(q4_1 ? 0 : 8);
#endif
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
           the hardware prefetcher does not pick up in time when the weights are not in the
           CPU's cache. A prefetch past the weight's end does not fault. */
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

/* CALL(M) with the row count m as the constant M (1..ROWS): a kernel inlined with it, so
   that the compiler unrolls its row loops and keeps its accumulators in registers. */
_Static_assert(ROWS == 8, "WITH_M has a case for each row count 1..ROWS");
#define WITH_M(CALL)                                                                         \
    switch (m) {                                                                             \
    case 1: CALL(1); break;                                                                  \
    case 2: CALL(2); break;                                                                  \
    case 3: CALL(3); break;                                                                  \
    case 4: CALL(4); break;                                                                  \
    case 5: CALL(5); break;                                                                  \
    case 6: CALL(6); break;                                                                  \
    case 7: CALL(7); break;                                                                  \
    case 8: CALL(8); break;                                                                  \
    default: break; /* no rows (callers pass 1..ROWS) */                                     \
    }

/* Q4_0 / Q4_1 weight rows R at a time by M rows of x: M * R <= 16 accumulators, and R
   dividing 32 (the demo's column chunks: fewer columns left to the one-at-a-time loop).
   The fastest of those tried on AVX-512 (benchmarks/q4_kernels.py). */
#define Q4_R(M) ((M) == 1 ? 8 : (M) <= 4 ? 4 : 2)
#define Q40(M) cols(w, 0, x, xsum, M, Q4_R(M), k, y, ldy, n0, n1)
#define Q41(M) cols(w, 1, x, xsum, M, Q4_R(M), k, y, ldy, n0, n1)

/* Rows of x rounded to 8 bits per block of 32, for the packed kernels: block b of row r is
   d[r, b] * q[r, b, :] with d = max |x| / 127 over the block and q = round(x / d) (to
   nearest, ties to even: x times 127 / max, as ggml's Q8 activations), s = d * sum(q)
   and sum = sum(q). Row r's arrays start at q + r * k and at d, s, sum + r * nb. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *sum;
} x8_t;

static inline x8_t x8_rows(x8_t a, int r0, int k) {
    const size_t nb = (size_t)(k / 32);
    return (x8_t){a.q + (size_t)r0 * k, a.d + r0 * nb, a.s + r0 * nb, a.sum + r0 * nb};
}

/* x [m, k] rounded as x8_t says into buf, which holds x8_bytes(m, k). */
static size_t x8_bytes(int m, int k) { return (size_t)m * k + (size_t)m * (k / 32) * 12; }
static x8_t x8_round(const float *x, int m, int k, uint8_t *buf) {
    const int nb = k / 32;
    float *d = (float *)buf, *s = d + (size_t)m * nb;
    int32_t *sum = (int32_t *)(s + (size_t)m * nb);
    int8_t *q = (int8_t *)(sum + (size_t)m * nb);
    for (int r = 0; r < m; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * k + (size_t)b * 32;
            int8_t *qb = q + (size_t)r * k + (size_t)b * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            int32_t t = 0;
            for (int i = 0; i < 32; i++) {
                qb[i] = (int8_t)nearbyintf(xb[i] * inv);
                t += qb[i];
            }
            d[(size_t)r * nb + b] = amax / 127.f;
            sum[(size_t)r * nb + b] = t;
            s[(size_t)r * nb + b] = d[(size_t)r * nb + b] * (float)t;
        }
    return (x8_t){q, d, s, sum};
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4_0 / Q4_1 weights packed by 16 rows (bevy_q4_pack) times x rounded to 8 bits (x8_t),
   in integers: ggml's way on the CPU, a few instructions per 32 weights where widening
   each weight to float took about 24. Group g (rows 16g .. 16g + 15) holds, for each
   block b in turn, the 16 rows' f16 d (32 bytes), for Q4_1 their f16 m (32 bytes), then
   their quant bytes in four runs of 64: run j holds row r's bytes 4j .. 4j + 3 at 4r.
   The same bytes as the blocks, reordered, so a slot packs in place. With the rows across
   the 32-bit lanes, the low nibbles of run j are each row's elements 4j .. 4j + 3 and the
   high ones 4j + 16 .. 4j + 19, each lane's four multiplied by the same four bytes of x
   and added in one instruction (VNNI's dpbusd, else maddubs then madd). Each output is
       y[r, n] = sum_b (d[n, b] * (dx[r, b] * i) + m[n, b] * s[r, b])
   with i the integer q[n, b, :] . qx[r, b, :] (Q4_0: (q - 8) . qx, no m): exactly the
   weights times x as rounded, the float operations in this order whatever m and the
   columns are, and the same on every instruction set (integers are exact). */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void q4p_cols(const uint8_t *w, const int q4_1,
                                                           const x8_t x8, const int m, int k,
                                                           float *y, int ldy, int n0, int n1) {
    const int nb = k / 32, bs = q4_1 ? 20 : 18, hs = q4_1 ? 64 : 32;
    const __m512i low = _mm512_set1_epi8(15);
#ifndef __AVX512VNNI__
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    for (int g = n0 / 16; g < n1 / 16; g++) {
        __m512 acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
        const uint8_t *c = w + (size_t)g * nb * 16 * bs;
        for (int b = 0; b < nb; b++, c += 16 * bs) {
            for (int j = 0; j < 16 * bs; j += 64) /* this block's lines, PF_AHEAD on */
                _mm_prefetch((const char *)(c + PF_AHEAD + j), _MM_HINT_T0);
            __m512i dot[ROWS];
            for (int r = 0; r < m; r++) dot[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512((const void *)(c + hs + 64 * j));
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < m; r++) {
                    const int8_t *xb = x8.q + (size_t)r * k + (size_t)b * 32 + 4 * j;
                    __m512i xl = _mm512_set1_epi32(load_i32(xb));
                    __m512i xh = _mm512_set1_epi32(load_i32(xb + 16));
#ifdef __AVX512VNNI__
                    dot[r] = _mm512_dpbusd_epi32(dot[r], lo, xl);
                    dot[r] = _mm512_dpbusd_epi32(dot[r], hi, xh);
#else
                    /* 16-bit sums: 8 pairs of at most 15 * 127 each, no saturation */
                    dot[r] = _mm512_add_epi16(dot[r], _mm512_maddubs_epi16(lo, xl));
                    dot[r] = _mm512_add_epi16(dot[r], _mm512_maddubs_epi16(hi, xh));
#endif
                }
            }
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c));
            for (int r = 0; r < m; r++) {
                const size_t rb = (size_t)r * nb + b;
#ifndef __AVX512VNNI__
                dot[r] = _mm512_madd_epi16(dot[r], ones);
#endif
                if (!q4_1) dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(8 * x8.sum[rb]));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(x8.d[rb]));
                acc[r] = _mm512_fmadd_ps(dv, t, acc[r]);
            }
            if (q4_1) {
                __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + 32)));
                for (int r = 0; r < m; r++)
                    acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x8.s[(size_t)r * nb + b]), acc[r]);
            }
        }
        for (int r = 0; r < m; r++) _mm512_storeu_ps(y + (size_t)r * ldy + (size_t)g * 16, acc[r]);
    }
}

#else
/* The same on AVX2 (8 lanes): each group of 16 rows in two halves of 8 (half h: rows 8h ..
   8h + 7, bytes 32h .. 32h + 31 of each run), rows of x at most four at a time (their
   sums and accumulators, 8 of the 16 vector registers); the next four read the group's
   bytes again, from the CPU's cache. `fetch`: the group's first pass, which prefetches. */
static inline __attribute__((always_inline)) void q4p_half(const uint8_t *c, const int q4_1,
                                                           const x8_t x8, const int m, int k,
                                                           float *y, int ldy, int h, int fetch) {
    const int nb = k / 32, bs = q4_1 ? 20 : 18, hs = q4_1 ? 64 : 32;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, c += 16 * bs) {
        if (fetch)
            for (int j = 0; j < 16 * bs; j += 64)
                _mm_prefetch((const char *)(c + PF_AHEAD + j), _MM_HINT_T0);
        __m256i dot[4];
        for (int r = 0; r < m; r++) dot[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(c + hs + 64 * j + 32 * h));
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < m; r++) {
                const int8_t *xb = x8.q + (size_t)r * k + (size_t)b * 32 + 4 * j;
                /* 16-bit sums: 8 pairs of at most 15 * 127 each, no saturation */
                dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xb))));
                dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xb + 16))));
            }
        }
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + 16 * h)));
        for (int r = 0; r < m; r++) {
            const size_t rb = (size_t)r * nb + b;
            __m256i i = _mm256_madd_epi16(dot[r], ones);
            if (!q4_1) i = _mm256_sub_epi32(i, _mm256_set1_epi32(8 * x8.sum[rb]));
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(x8.d[rb]));
            acc[r] = _mm256_fmadd_ps(dv, t, acc[r]);
        }
        if (q4_1) {
            __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + 32 + 16 * h)));
            for (int r = 0; r < m; r++)
                acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x8.s[(size_t)r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(y + (size_t)r * ldy + 8 * h, acc[r]);
}

static inline __attribute__((always_inline)) void q4p_cols(const uint8_t *w, const int q4_1,
                                                           const x8_t x8, const int m, int k,
                                                           float *y, int ldy, int n0, int n1) {
    const int nb = k / 32, bs = q4_1 ? 20 : 18;
    for (int g = n0 / 16; g < n1 / 16; g++) {
        const uint8_t *c = w + (size_t)g * nb * 16 * bs;
        for (int h = 0; h < 2; h++)
            for (int r0 = 0; r0 < m; r0 += 4) {
                const x8_t xr = x8_rows(x8, r0, k);
                float *yr = y + (size_t)r0 * ldy + (size_t)g * 16;
                if (m - r0 >= 4)
                    q4p_half(c, q4_1, xr, 4, k, yr, ldy, h, !h && !r0);
                else if (m - r0 == 3)
                    q4p_half(c, q4_1, xr, 3, k, yr, ldy, h, !h && !r0);
                else if (m - r0 == 2)
                    q4p_half(c, q4_1, xr, 2, k, yr, ldy, h, !h && !r0);
                else
                    q4p_half(c, q4_1, xr, 1, k, yr, ldy, h, !h && !r0);
            }
    }
}
#endif
#define Q40P(M) q4p_cols(w, 0, x8, M, k, y, ldy, n0, n1)
#define Q41P(M) q4p_cols(w, 1, x8, M, k, y, ldy, n0, n1)

/* Q4_0 / Q4_1 blocks as stored times x rounded to 8 bits (x8_t): the packed kernels'
   products bit for bit, without packing (an expert as its slot or file holds it), so an
   expert's results do not depend on whether it was packed. With AVX-512, sixteen weight
   rows at a time first (q4x_cols16); then (and with AVX2) eight at a time, one to a
   lane: each row's block widened once to its 32 nibbles in x's order (byte i's low
   nibble is element i, its high one element i + 16), its integer dot with each row of x
   summed across the vector (integers: exact), the eight rows' sums gathered into one
   vector, then per lane the float operations of q4p_cols in the same order. */
static inline __m256i nibbles32(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(15));
}

/* Eight 32-bit partial sums of w (unsigned) times x (signed), byte by byte. */
static inline __m256i dot32(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    /* 16-bit sums of pairs: at most 2 * 15 * 127, no saturation */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* Lane i: the sum of v[i]'s eight lanes. */
static inline __m256i lane_sums(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* a: rows 0-3's sums of elements 0-3 in its low half, of 4-7 in its high; c: rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20),
                            _mm256_permute2x128_si256(a, c, 0x31));
}

#ifdef __AVX512F__
/* Sixteen weight rows at a time on AVX-512, the packed kernel's vector of 16 rows from the
   blocks as stored: vector i holds the quant bytes of rows i, i + 4, i + 8 and i + 12,
   one to each 128-bit lane, whose four 32-bit sums after the integer dots (x's 32 bytes
   as two 16-byte halves, the same in every lane) are that row's; adding each lane's four
   across the four vectors (two rounds of unpack and add) leaves row r's sum in lane r.
   The scales come in with one gather. Returns the first row left (fewer than 16). */
static inline __attribute__((always_inline)) int q4x_cols16(const uint8_t *w, const int q4_1,
                                                            const x8_t x8, const int m, int k,
                                                            float *y, int ldy, int n0, int n1) {
    const int nb = k / 32, bs = q4_1 ? 20 : 18, hs = q4_1 ? 4 : 2;
    const size_t row = (size_t)nb * bs;
    const __m512i low = _mm512_set1_epi8(15);
#ifndef __AVX512VNNI__
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    int n = n0;
    for (; n + 16 <= n1; n += 16) {
        __m512 acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
        const uint8_t *w0 = w + (size_t)n * row, *next = w0 + 16 * row;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w0 + (size_t)b * bs, *q = blk + hs;
            /* The next 16 rows (cols' reason), which follow these in memory: their bytes in
               order, 16 * bs of them for each block of these (at most five cache lines) */
            for (int j = 0; j < 5; j++)
                _mm_prefetch((const char *)(next + ((size_t)b * 5 + j) * 64), _MM_HINT_T0);
            __m512i lo[4], hi[4], head[4];
            for (int i = 0; i < 4; i++) {
#define ROWS4(P)                                                                             \
    _mm512_inserti32x4(                                                                      \
        _mm512_inserti32x4(                                                                  \
            _mm512_inserti32x4(_mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)((P) + (size_t)i * row))), \
                               _mm_loadu_si128((const __m128i *)((P) + (size_t)(i + 4) * row)), 1), \
            _mm_loadu_si128((const __m128i *)((P) + (size_t)(i + 8) * row)), 2),             \
        _mm_loadu_si128((const __m128i *)((P) + (size_t)(i + 12) * row)), 3)
                const __m512i v = ROWS4(q);
                head[i] = ROWS4(blk);
#undef ROWS4
                lo[i] = _mm512_and_si512(v, low);
                hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            /* each row's first four bytes (f16 d, then Q4_1's f16 m), lane by lane in row
               order: the first 32 bits of each lane of head[0..3], interleaved */
            const __m512i sc = _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(head[0], head[1]),
                                                     _mm512_unpacklo_epi32(head[2], head[3]));
            const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sc));
            const __m512 mv = q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sc, 16)))
                                   : _mm512_setzero_ps();
            for (int r = 0; r < m; r++) {
                const size_t rb = (size_t)r * nb + b;
                const int8_t *xb = x8.q + (size_t)r * k + (size_t)b * 32;
                const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xb));
                const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xb + 16)));
                __m512i s[4];
                for (int i = 0; i < 4; i++) {
#ifdef __AVX512VNNI__
                    s[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], xl), hi[i], xh);
#else
                    /* 16-bit sums: 4 pairs of at most 15 * 127 each, no saturation */
                    s[i] = _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo[i], xl),
                                                              _mm512_maddubs_epi16(hi[i], xh)),
                                             ones);
#endif
                }
                const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]),
                                                    _mm512_unpackhi_epi32(s[0], s[1]));
                const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]),
                                                    _mm512_unpackhi_epi32(s[2], s[3]));
                __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
                if (!q4_1) t = _mm512_sub_epi32(t, _mm512_set1_epi32(8 * x8.sum[rb]));
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(x8.d[rb]));
                acc[r] = _mm512_fmadd_ps(dv, f, acc[r]);
                if (q4_1) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x8.s[rb]), acc[r]);
            }
        }
        for (int r = 0; r < m; r++) _mm512_storeu_ps(y + (size_t)r * ldy + n, acc[r]);
    }
    return n;
}
#endif

static inline __attribute__((always_inline)) void q4x_cols(const uint8_t *w, const int q4_1,
                                                           const x8_t x8, const int m, int k,
                                                           float *y, int ldy, int n0, int n1) {
    const int nb = k / 32, bs = q4_1 ? 20 : 18, hs = q4_1 ? 4 : 2;
    const size_t row = (size_t)nb * bs;
#ifdef __AVX512F__
    int n = q4x_cols16(w, q4_1, x8, m, k, y, ldy, n0, n1);
#else
    int n = n0;
#endif
    for (; n + 8 <= n1; n += 8) {
        __m256 acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
        const uint8_t *w0 = w + (size_t)n * row, *next = w0 + 8 * row;
        for (int b = 0; b < nb; b++) {
            __m256i wb[8];
            const uint8_t *blk = w0 + (size_t)b * bs;
            for (int i = 0; i < 8; i++) {
                /* (the next eight rows, as cols does: short streams the hardware misses) */
                _mm_prefetch((const char *)(next + (size_t)i * row + (size_t)b * bs), _MM_HINT_T0);
                wb[i] = nibbles32(blk + (size_t)i * row + hs);
            }
#define F16S(O)                                                                              \
    _mm256_setr_ps(f16_at(blk + (O)), f16_at(blk + row + (O)), f16_at(blk + 2 * row + (O)),   \
                   f16_at(blk + 3 * row + (O)), f16_at(blk + 4 * row + (O)),                  \
                   f16_at(blk + 5 * row + (O)), f16_at(blk + 6 * row + (O)),                  \
                   f16_at(blk + 7 * row + (O)))
            const __m256 dv = F16S(0), mv = q4_1 ? F16S(2) : _mm256_setzero_ps();
#undef F16S
            for (int r = 0; r < m; r++) {
                const size_t rb = (size_t)r * nb + b;
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x8.q + (size_t)r * k + (size_t)b * 32));
                __m256i v[8];
                for (int i = 0; i < 8; i++) v[i] = dot32(wb[i], xv);
                __m256i s = lane_sums(v);
                if (!q4_1) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * x8.sum[rb]));
                const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x8.d[rb]));
                acc[r] = _mm256_fmadd_ps(dv, t, acc[r]);
                if (q4_1) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x8.s[rb]), acc[r]);
            }
        }
        for (int r = 0; r < m; r++) _mm256_storeu_ps(y + (size_t)r * ldy + n, acc[r]);
    }
    for (; n < n1; n++) { /* the same operations one row at a time (fmaf: fused, as above) */
        float acc[ROWS] = {0};
        const uint8_t *w0 = w + (size_t)n * row;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w0 + (size_t)b * bs, *q = blk + hs;
            const float d = f16_at(blk), c = q4_1 ? f16_at(blk + 2) : 0.f;
            for (int r = 0; r < m; r++) {
                const size_t rb = (size_t)r * nb + b;
                const int8_t *xb = x8.q + (size_t)r * k + (size_t)b * 32;
                int32_t i = 0;
                for (int j = 0; j < 16; j++) i += (q[j] & 15) * xb[j] + (q[j] >> 4) * xb[j + 16];
                if (!q4_1) i -= 8 * x8.sum[rb];
                acc[r] = fmaf(d, (float)i * x8.d[rb], acc[r]);
                if (q4_1) acc[r] = fmaf(c, x8.s[rb], acc[r]);
            }
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc[r];
    }
}
#define Q40X(M) q4x_cols(w, 0, x8, M, k, y, ldy, n0, n1)
#define Q41X(M) q4x_cols(w, 1, x8, M, k, y, ldy, n0, n1)

/* The kernels that read x rounded (reads_x8), by their type code, each with m constant. */
static __attribute__((noinline)) void x8_any(const uint8_t *w, int type, const x8_t x8, int m,
                                             int k, float *y, int ldy, int n0, int n1) {
    if (type == T_Q40_PACKED)
        WITH_M(Q40P)
    else if (type == T_Q41_PACKED)
        WITH_M(Q41P)
    else if (type == T_Q40_X8)
        WITH_M(Q40X)
    else
        WITH_M(Q41X)
}

/* Sub-block j's 6-bit scale and min of a Q4_K super-block's 12 packed bytes s (ggml's
   get_scale_min_k4). */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* One Q4_K / Q5_K sub-block: its 32 weights as floats W0 (the first 16) and W1 (AVX-512),
   times each x row at XOFF, scaled by dv, added to acc; cv times the rows' sub-block sums
   to tail. KSUB takes the weights as 32 bytes V (values 0-31). */
#ifdef __AVX512F__
#define KSUBF(W0, W1, XOFF)                                                                  \
    {                                                                                        \
        __m512 dvv = _mm512_set1_ps(dv);                                                     \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (XOFF);                                    \
            __m512 s = _mm512_mul_ps(W0, _mm512_loadu_ps(xb));                               \
            s = _mm512_fmadd_ps(W1, _mm512_loadu_ps(xb + 16), s);                            \
            acc[r] = _mm512_fmadd_ps(dvv, s, acc[r]);                                        \
            tail[r] += cv * xsum[(size_t)r * nb + (XOFF) / 32];                              \
        }                                                                                    \
    }
#define KSUB(V, XOFF)                                                                        \
    {                                                                                        \
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(V)));     \
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(V, 1))); \
        KSUBF(w0, w1, XOFF)                                                                  \
    }
#else
#define KSUB(V, XOFF)                                                                        \
    {                                                                                        \
        __m128i a = _mm256_castsi256_si128(V), b = _mm256_extracti128_si256(V, 1);           \
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));                             \
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));          \
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));                             \
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));          \
        __m256 dvv = _mm256_set1_ps(dv);                                                     \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (XOFF);                                    \
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));                               \
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);                             \
            s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);                            \
            s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);                            \
            acc[r] = _mm256_fmadd_ps(dvv, s, acc[r]);                                        \
            tail[r] += cv * xsum[(size_t)r * nb + (XOFF) / 32];                              \
        }                                                                                    \
    }
#endif

/* Q4_K and Q5_K (k a multiple of 256): super-blocks of 256 weights with f16 d, f16 dmin and
   12 bytes of 6-bit scales and mins of their 8 sub-blocks of 32 (bytes 0-15), then Q4_K:
   128 bytes whose 32-byte run j holds sub-block 2j in its low nibbles and 2j + 1 in its
   high ones (144 bytes); Q5_K: 32 bytes qh whose bits 2j and 2j + 1 are the fifth bits
   (16) of those two sub-blocks' weights, then the nibbles as Q4_K's (176 bytes). A weight
   is d * sc * q - dmin * mn: each sub-block a Q4_1-like block of scale d * sc and offset
   -dmin * mn, summed as Q4_1's are (each row on its own, in one order). */
static inline __attribute__((always_inline)) void qk_cols(const uint8_t *w, const int five,
                                                          const float *x, const float *xsum,
                                                          const int m, int k, float *y, int ldy,
                                                          int n0, int n1) {
    const int ns = k / 256, nb = k / 32;
    const size_t bs = five ? 176 : 144;
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(0x01);
#ifdef __AVX512F__
    /* Each nibble's weight looked up by the nibble (as in cols). */
    const __m512 nib = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    for (int n = n0; n < n1; n++) {
        acc_t acc[ROWS];
        float tail[ROWS];
        for (int r = 0; r < m; r++) {
            acc[r] = acc_zero();
            tail[r] = 0.f;
        }
        const uint8_t *row = w + (size_t)n * ns * bs;
        for (int sb = 0; sb < ns; sb++) {
            const uint8_t *blk = row + (size_t)sb * bs;
            for (size_t ahead = 0; ahead < bs; ahead += 64)
                _mm_prefetch((const char *)(blk + bs + ahead), _MM_HINT_T0);
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            const uint8_t *qs = blk + (five ? 48 : 16);
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                    : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                int sc, mn;
                float dv, cv;
#ifdef __AVX512F__
                if (!five) {
                    const __m128i *q = (const __m128i *)(qs + 32 * j);
                    const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(q));
                    const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(q + 1));
                    const __m512 l0 = _mm512_permutexvar_ps(q0, nib);
                    const __m512 l1 = _mm512_permutexvar_ps(q1, nib);
                    q4k_scale_min(blk + 4, 2 * j, &sc, &mn);
                    dv = d * (float)sc;
                    cv = dmin * (float)mn;
                    KSUBF(l0, l1, sb * 256 + 64 * j)
                    const __m512 h0 = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), nib);
                    const __m512 h1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), nib);
                    q4k_scale_min(blk + 4, 2 * j + 1, &sc, &mn);
                    dv = d * (float)sc;
                    cv = dmin * (float)mn;
                    KSUBF(h0, h1, sb * 256 + 64 * j + 32)
                    continue;
                }
#endif
                __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                __m256i lo = _mm256_and_si256(q, low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                if (five) {
                    __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one);
                    __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                }
                q4k_scale_min(blk + 4, 2 * j, &sc, &mn);
                dv = d * (float)sc;
                cv = dmin * (float)mn;
                KSUB(lo, sb * 256 + 64 * j)
                q4k_scale_min(blk + 4, 2 * j + 1, &sc, &mn);
                dv = d * (float)sc;
                cv = dmin * (float)mn;
                KSUB(hi, sb * 256 + 64 * j + 32)
            }
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]) - tail[r];
    }
}

#define QK4(M) qk_cols(w, 0, x, xsum, M, k, y, ldy, n0, n1)
#define QK5(M) qk_cols(w, 1, x, xsum, M, k, y, ldy, n0, n1)

/* 16 signed 6-bit weights (int8, bytes Q) times each x row at XOFF, scaled by dv, to ACC. */
#ifdef __AVX512F__
#define K6SUB(Q, XOFF)                                                                       \
    {                                                                                        \
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(Q));                             \
        __m512 dvv = _mm512_set1_ps(dv);                                                     \
        for (int r = 0; r < m; r++) {                                                        \
            __m512 s = _mm512_mul_ps(w0, _mm512_loadu_ps(x + (size_t)r * k + (XOFF)));       \
            acc[r] = _mm512_fmadd_ps(dvv, s, acc[r]);                                        \
        }                                                                                    \
    }
#else
#define K6SUB(Q, XOFF)                                                                       \
    {                                                                                        \
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(Q));                             \
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(Q, 8)));          \
        __m256 dvv = _mm256_set1_ps(dv);                                                     \
        for (int r = 0; r < m; r++) {                                                        \
            const float *xb = x + (size_t)r * k + (XOFF);                                    \
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));                               \
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);                             \
            acc[r] = _mm256_fmadd_ps(dvv, s, acc[r]);                                        \
        }                                                                                    \
    }
#endif

/* Q6_K (k a multiple of 256): super-blocks of 256 weights, 210 bytes: 128 bytes of low
   nibbles (ql), 64 of high bit pairs (qh), 16 int8 scales (one per 16 weights), f16 d. In
   each half of 128 (ql + 64 h, qh + 32 h, scales + 8 h), group g of 32 weights takes the
   low (g < 2) or high nibbles of ql's 32 bytes at 32 (g & 1), and bits 2g, 2g + 1 of qh's
   32 bytes as bits 4 and 5; a weight is d * scale * (q - 32), scale sc[2g] for its first
   16 and sc[2g + 1] for the rest (ggml's dequantize_row_q6_K). */
static inline __attribute__((always_inline)) void q6k_cols(const uint8_t *w, const float *x,
                                                           const int m, int k, float *y,
                                                           int ldy, int n0, int n1) {
    const int ns = k / 256;
    const size_t bs = 210;
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    const __m256i off = _mm256_set1_epi8(32);
    for (int n = n0; n < n1; n++) {
        acc_t acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = acc_zero();
        const uint8_t *row = w + (size_t)n * ns * bs;
        for (int sb = 0; sb < ns; sb++) {
            const uint8_t *blk = row + (size_t)sb * bs;
            _mm_prefetch((const char *)(blk + bs), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk + bs + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk + bs + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk + bs + 192), _MM_HINT_T0);
            const float d = f16_at(blk + 208);
            const int8_t *scales = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
                for (int g = 0; g < 4; g++) {
                    __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * (g & 1)));
                    if (g >= 2) l = _mm256_srli_epi16(l, 4);
                    l = _mm256_and_si256(l, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), two);
                    __m256i q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hi, 4)), off);
                    const int at = sb * 256 + 128 * h + 32 * g;
                    float dv = d * (float)scales[8 * h + 2 * g];
                    K6SUB(_mm256_castsi256_si128(q), at)
                    dv = d * (float)scales[8 * h + 2 * g + 1];
                    K6SUB(_mm256_extracti128_si256(q, 1), at + 16)
                }
            }
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]);
    }
}

/* Q3_K (k a multiple of 256): super-blocks of 256 weights, 110 bytes: 32 bytes hmask, 64
   bytes of 2-bit weights, 12 bytes of 16 packed 6-bit scales, f16 d. In half h of 128, group
   j of 32 takes bits 2j, 2j + 1 of the 32 bytes at 32 h, less 4 unless bit 4h + j of its
   hmask byte is set; a weight is d * (scale - 32) * q, one scale per 16 weights
   (ggml's dequantize_row_q3_K). */
static inline __attribute__((always_inline)) void q3k_cols(const uint8_t *w, const float *x,
                                                           const int m, int k, float *y,
                                                           int ldy, int n0, int n1) {
    const int ns = k / 256;
    const size_t bs = 110;
    const __m256i three = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(0x01);
    const __m256i four = _mm256_set1_epi8(4);
    for (int n = n0; n < n1; n++) {
        acc_t acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = acc_zero();
        const uint8_t *row = w + (size_t)n * ns * bs;
        for (int sb = 0; sb < ns; sb++) {
            const uint8_t *blk = row + (size_t)sb * bs;
            _mm_prefetch((const char *)(blk + bs), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk + bs + 64), _MM_HINT_T0);
            const float d = f16_at(blk + 108);
            uint32_t aux[4];
            memcpy(aux, blk + 96, 12);
            const uint32_t tmp = aux[2], m1 = 0x03030303, m2 = 0x0f0f0f0f;
            aux[2] = ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
            aux[3] = ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
            aux[0] = (aux[0] & m2) | (((tmp >> 0) & m1) << 4);
            aux[1] = (aux[1] & m2) | (((tmp >> 2) & m1) << 4);
            const int8_t *scales = (const int8_t *)aux;
            const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
            for (int h = 0; h < 2; h++) {
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
                for (int j = 0; j < 4; j++) {
                    __m256i q = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), three);
                    __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one);
                    q = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_slli_epi16(hb, 2)), four);
                    const int at = sb * 256 + 128 * h + 32 * j;
                    float dv = d * (float)(scales[8 * h + 2 * j] - 32);
                    K6SUB(_mm256_castsi256_si128(q), at)
                    dv = d * (float)(scales[8 * h + 2 * j + 1] - 32);
                    K6SUB(_mm256_extracti128_si256(q, 1), at + 16)
                }
            }
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]);
    }
}

/* IQ4_XS (k a multiple of 256): super-blocks of 256 weights, 136 bytes: f16 d, 16 bits of
   high scale bits, 4 bytes of low ones, then 16 bytes per sub-block of 32 (low nibbles its
   first 16 weights, high nibbles the rest), each nibble an index into IQ4_NL's 16 values;
   a weight is d * (scale - 32) * value (ggml's dequantize_row_iq4_xs). */
static inline __attribute__((always_inline)) void iq4xs_cols(const uint8_t *w, const float *x,
                                                             const int m, int k, float *y,
                                                             int ldy, int n0, int n1) {
    const int ns = k / 256;
    const size_t bs = 136;
    const __m128i values = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                         53, 69, 89, 113);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int n = n0; n < n1; n++) {
        acc_t acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = acc_zero();
        const uint8_t *row = w + (size_t)n * ns * bs;
        for (int sb = 0; sb < ns; sb++) {
            const uint8_t *blk = row + (size_t)sb * bs;
            _mm_prefetch((const char *)(blk + bs), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk + bs + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk + bs + 128), _MM_HINT_T0);
            const float d = f16_at(blk);
            uint16_t sh;
            memcpy(&sh, blk + 2, 2);
            for (int ib = 0; ib < 8; ib++) {
                const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
                const float dv = d * (float)(ls - 32);
                const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * ib));
                const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(q, low));
                const __m128i hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), low));
                const int at = sb * 256 + 32 * ib;
                K6SUB(lo, at)
                K6SUB(hi, at + 16)
            }
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]);
    }
}

/* Q5_0: blocks of 32 weights, 22 bytes: f16 d, 32 bits qh (the fifth bit of weight j is
   bit j), 16 bytes of nibbles (weight j low, j + 16 high); a weight is d * (q - 16)
   (ggml's dequantize_row_q5_0). */
static inline __attribute__((always_inline)) void q50_cols(const uint8_t *w, const float *x,
                                                           const int m, int k, float *y,
                                                           int ldy, int n0, int n1) {
    const int nb = k / 32;
    const size_t bs = 22;
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i five = _mm256_set1_epi8(0x10), off = _mm256_set1_epi8(16);
    for (int n = n0; n < n1; n++) {
        acc_t acc[ROWS];
        for (int r = 0; r < m; r++) acc[r] = acc_zero();
        const uint8_t *row = w + (size_t)n * nb * bs;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bs;
            _mm_prefetch((const char *)(blk + (size_t)nb * bs), _MM_HINT_T0); /* next row's */
            const float dv = f16_at(blk);
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            /* byte j: 0xFF where bit j of qh is set */
            __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
            hb = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
            __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low),
                                         _mm_and_si128(qs, low));
            q = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_and_si256(hb, five)), off);
            K6SUB(_mm256_castsi256_si128(q), 32 * b)
            K6SUB(_mm256_extracti128_si256(q, 1), 32 * b + 16)
        }
        for (int r = 0; r < m; r++) y[(size_t)r * ldy + n] = acc_sum(acc[r]);
    }
}

static inline __attribute__((always_inline)) void q8_cols(const uint8_t *w, const float *x,
                                                          const int m, int k, float *y,
                                                          int ldy, int n0, int n1);

/* Each kernel once per row count (WITH_M), behind one call: out of line, so that q4_cols,
   which the Q4_0 / Q4_1 loops are inlined into, stays the size it was (with all of them
   inlined into it, the demo's decoding A/B leaned slower: docs/performance.md). */
#define Q50(M) q50_cols(w, x, M, k, y, ldy, n0, n1)
#define IQ4XS(M) iq4xs_cols(w, x, M, k, y, ldy, n0, n1)
#define Q3K(M) q3k_cols(w, x, M, k, y, ldy, n0, n1)
#define Q8(M) q8_cols(w, x, M, k, y, ldy, n0, n1)
#define Q6K(M) q6k_cols(w, x, M, k, y, ldy, n0, n1)
#define BY_M(NAME, KERNEL)                                                                   \
    static __attribute__((noinline)) void NAME(const uint8_t *w, const float *x, int m,     \
                                               int k, float *y, int ldy, int n0, int n1) {  \
        WITH_M(KERNEL)                                                                       \
    }
BY_M(q50_any, Q50)
BY_M(iq4xs_any, IQ4XS)
BY_M(q3k_any, Q3K)
BY_M(q8_any, Q8)
BY_M(q6k_any, Q6K)

static __attribute__((noinline)) void qk_any(const uint8_t *w, int five, const float *x,
                                             const float *xsum, int m, int k, float *y,
                                             int ldy, int n0, int n1) {
    if (five)
        WITH_M(QK5)
    else
        WITH_M(QK4)
}

/* y[r, n] for r < m (1 <= m <= ROWS) and n0 <= n < n1; y has row stride ldy. type: the
   weight's blocks, 0 Q4_0, 1 Q4_1, 2 Q4_K, 3 Q6_K, 4 Q5_K, 5 Q8_0, 6 Q3_K, 7 IQ4_XS,
   8 Q5_0; T_Q40_PACKED and T_Q41_PACKED: Q4_0 / Q4_1 packed by 16 rows, which read x
   as x8 rounds it (and not x), n0 and n1 multiples of 16 (col_edge gives such edges);
   T_Q40_X8 and T_Q41_X8: Q4_0 / Q4_1 as stored, read as the packed ones are. */
static void q4_cols(const uint8_t *w, int type, const float *x, const float *xsum, const x8_t x8,
                    int m, int k, float *y, int ldy, int n0, int n1) {
    if (reads_x8(type)) {
        x8_any(w, type, x8, m, k, y, ldy, n0, n1);
        return;
    }
    if (type == 8)
        q50_any(w, x, m, k, y, ldy, n0, n1);
    else if (type == 7)
        iq4xs_any(w, x, m, k, y, ldy, n0, n1);
    else if (type == 6)
        q3k_any(w, x, m, k, y, ldy, n0, n1);
    else if (type == 5)
        q8_any(w, x, m, k, y, ldy, n0, n1);
    else if (type == 4)
        qk_any(w, 1, x, xsum, m, k, y, ldy, n0, n1);
    else if (type == 3)
        q6k_any(w, x, m, k, y, ldy, n0, n1);
    else if (type == 2)
        qk_any(w, 0, x, xsum, m, k, y, ldy, n0, n1);
    else if (type == 1)
        WITH_M(Q41)
    else
        WITH_M(Q40)
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

/* Chunk t's first column of n shared into `chunks`: a multiple of 16, as packed weights
   need (16 rows to a group), and n for t = chunks. Where the columns are cut does not
   change any output's bits. */
static inline int col_edge(int n, int t, int chunks) {
    return t == chunks ? n : (int)((long)n * t / chunks) & ~15;
}

/* y [M, N] = x [M, K] @ W.T for W [N, K] in Q4 blocks (type as for q4_cols), on `threads`
   threads. 0 on success, -1 if out of memory. */
int bevy_q4_linear(const uint8_t *w, int type, const float *x, float *y, int M, int N, int K,
                   int threads) {
    const int nb = K / 32, chunks = n_chunks(N);
    const size_t rounded = reads_x8(type) ? x8_bytes(M, K) : 0;
    float *xsum = malloc(sizeof(float) * (size_t)M * nb + rounded + 1);
    if (!xsum) return -1;
    block_sums(x, xsum, M, K);
    const x8_t x8 = rounded ? x8_round(x, M, K, (uint8_t *)(xsum + (size_t)M * nb)) : (x8_t){0};
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        int m = M - r0 < ROWS ? M - r0 : ROWS;
        const x8_t xr = rounded ? x8_rows(x8, r0, K) : x8;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int t = 0; t < chunks; t++)
            q4_cols(w, type, x + (size_t)r0 * K, xsum + (size_t)r0 * nb, xr, m, K,
                    y + (size_t)r0 * N, N, col_edge(N, t, chunks), col_edge(N, t + 1, chunks));
    }
    free(xsum);
    return 0;
}

/* GELU's tanh approximation, as transformers' gelu_pytorch_tanh writes it. */
static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

/* Rows of x from which a stored Q4_0 / Q4_1 expert part is multiplied from a packed copy
   (pack_copy): the copy costs a pass over the part's bytes and its pages' first touch,
   which the packed kernel's speed repays from about here with AVX-512 and with AVX2
   alike (benchmarks/q4_kernels.py --packed). */
#define PACK_FROM_ROWS 128

/* A packed copy (bevy_q4_pack) of stored Q4_0 / Q4_1 weight *w [n, k] (*type T_Q40_X8 or
   T_Q41_X8), the same products (q4x_cols gives the packed kernel's bits); *w and *type
   become the copy's. NULL, leaving them, where the weight does not pack or memory runs
   out (the stored kernel then multiplies it). */
static uint8_t *pack_copy(const uint8_t **w, int *type, int n, int k, int threads) {
    if (*type != T_Q40_X8 && *type != T_Q41_X8) return NULL;
    const int q4_1 = *type == T_Q41_X8;
    const size_t bytes = (size_t)n * (k / 32) * (q4_1 ? 20 : 18);
    uint8_t *copy = malloc(bytes + 1);
    if (!copy) return NULL;
    memcpy(copy, *w, bytes);
    const int code = bevy_q4_pack(copy, q4_1, n, k, threads);
    if (code < 0) {
        free(copy);
        return NULL;
    }
    *w = copy;
    *type = code;
    return copy;
}

static int expert_mlp(const uint8_t *gate, const uint8_t *up, const uint8_t *down, int gq,
                      int uq, int dq, int gelu, const float *x, float *out, int M, int inner,
                      int hidden, int threads);

/* out [M, hidden] = down(act(gate(x)) * up(x)) for one expert; x [M, hidden]; gate and up
   [inner, hidden], down [hidden, inner]. types: bits 0-3, 4-7, 8-11: gate's, up's and
   down's block type (as for q4_cols); bit 12: act is GELU (tanh), else SiLU. Q4_0 and
   Q4_1 parts read x (and the inner activation) rounded to 8 bits, packed or not.
   On `threads` threads; 0 on success, -1 if out of memory. */
int bevy_q4_expert_mlp(const uint8_t *gate, const uint8_t *up, const uint8_t *down, int types,
                       const float *x, float *out, int M, int inner, int hidden, int threads) {
    int gq = x8_code(types & 15), uq = x8_code((types >> 4) & 15), dq = x8_code((types >> 8) & 15);
    uint8_t *copies[3] = {0};
    if (M >= PACK_FROM_ROWS) {
        copies[0] = pack_copy(&gate, &gq, inner, hidden, threads);
        copies[1] = pack_copy(&up, &uq, inner, hidden, threads);
        copies[2] = pack_copy(&down, &dq, hidden, inner, threads);
    }
    const int rc = expert_mlp(gate, up, down, gq, uq, dq, (types >> 12) & 1, x, out, M, inner,
                              hidden, threads);
    for (int i = 0; i < 3; i++) free(copies[i]);
    return rc;
}

static int expert_mlp(const uint8_t *gate, const uint8_t *up, const uint8_t *down, int gq,
                      int uq, int dq, int gelu, const float *x, float *out, int M, int inner,
                      int hidden, int threads) {
    const int nbh = hidden / 32, nbi = inner / 32;
    const int ci = n_chunks(inner), ch = n_chunks(hidden);
    /* x rounded to 8 bits for packed gate or up, each pass's h for a packed down */
    const size_t xr8 = reads_x8(gq) || reads_x8(uq) ? x8_bytes(M, hidden) : 0;
    const size_t hr8 = reads_x8(dq) ? x8_bytes(ROWS, inner) : 0;
    float *h = malloc(sizeof(float) * ((size_t)M * inner * 2 + (size_t)M * (nbh + nbi)) + xr8 +
                      hr8 + 1);
    if (!h) return -1;
    float *u = h + (size_t)M * inner, *xsum = u + (size_t)M * inner, *hsum = xsum + (size_t)M * nbh;
    uint8_t *x8buf = (uint8_t *)(hsum + (size_t)M * nbi), *h8buf = x8buf + xr8;
    block_sums(x, xsum, M, hidden);
    const x8_t x8 = xr8 ? x8_round(x, M, hidden, x8buf) : (x8_t){0};
    x8_t h8 = {0};
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        int m = M - r0 < ROWS ? M - r0 : ROWS;
        const float *xr = x + (size_t)r0 * hidden, *xs = xsum + (size_t)r0 * nbh;
        const x8_t x8r = xr8 ? x8_rows(x8, r0, hidden) : x8;
        float *hr = h + (size_t)r0 * inner, *ur = u + (size_t)r0 * inner;
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int t = 0; t < ci; t++) {
                int n0 = col_edge(inner, t, ci), n1 = col_edge(inner, t + 1, ci);
                q4_cols(gate, gq, xr, xs, x8r, m, hidden, hr, inner, n0, n1);
                q4_cols(up, uq, xr, xs, x8r, m, hidden, ur, inner, n0, n1);
                for (int r = 0; r < m; r++)
                    for (int n = n0; n < n1; n++) {
                        float g = hr[(size_t)r * inner + n];
                        float a = gelu ? gelu_tanh(g) : g / (1.f + expf(-g));
                        hr[(size_t)r * inner + n] = a * ur[(size_t)r * inner + n];
                    }
            }
#pragma omp single
            {
                block_sums(hr, hsum + (size_t)r0 * nbi, m, inner);
                if (hr8) h8 = x8_round(hr, m, inner, h8buf);
            }
            /* (the implicit barrier after single: every thread sees all of hsum and h8) */
#pragma omp for schedule(static)
            for (int t = 0; t < ch; t++)
                q4_cols(down, dq, hr, hsum + (size_t)r0 * nbi, h8, m, inner,
                        out + (size_t)r0 * hidden, hidden, col_edge(hidden, t, ch),
                        col_edge(hidden, t + 1, ch));
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

/* Rows r0 <= r < r1 of expert e of a bevy_q4_moe call (its gathered rows in xg) into og,
   on `threads` threads. */
static int moe_rows(const uint64_t *weights, const int *types, const int *first, int e, int r0,
                    int r1, const float *xg, float *og, int inner, int hidden, int threads) {
    const size_t at = (size_t)(first[e] + r0) * hidden;
    return bevy_q4_expert_mlp((const uint8_t *)weights[3 * e], (const uint8_t *)weights[3 * e + 1],
                              (const uint8_t *)weights[3 * e + 2], types[e], xg + at, og + at,
                              r1 - r0, inner, hidden, threads);
}

/* The fewest rows of an expert's that a thread takes as a piece of its own (below, where
   a call has fewer experts than two a thread, each expert's columns are shared). */
#define PIECE_ROWS 64

/* Pieces an expert's `rows` are cut into: `want`, as far as each keeps PIECE_ROWS. */
static inline int moe_pieces(int rows, int want) {
    const int p = rows / PIECE_ROWS < want ? rows / PIECE_ROWS : want;
    return p > 1 ? p : 1;
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
   the products are then added in order. With fewer experts but many rows each (a long
   prompt's part of a layer), the experts' rows are cut into pieces of at least
   PIECE_ROWS that the threads take the same way: sharing an expert's columns instead
   costs a parallel region and a serial rounding of its activations every ROWS rows. A
   row's products do not depend on which other rows are multiplied with it, so the
   pieces give the same bits. With fewer of either, each expert's columns are shared. */
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
    /* Pieces of each expert's rows so that every thread has two to take (1: whole experts). */
    const int want = threads > 1 && n_experts < 2 * threads ? (2 * threads + n_experts - 1) / n_experts : 1;
    int n_pieces = n_experts;
    if (want > 1)
        for (int e = 0; e < n_experts; e++) n_pieces += moe_pieces(counts[e], want) - 1;
    if (threads > 1 && n_pieces >= 2 * threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
        for (int i = 0; i < n_pieces; i++) {
            int e = i, q = 0, p = 1; /* piece i is expert e's q-th of p */
            if (want > 1)
                for (e = 0, q = i; q >= (p = moe_pieces(counts[e], want)); e++) q -= p;
            failed |= moe_rows(weights, types, first, e, (int)((long)counts[e] * q / p),
                               (int)((long)counts[e] * (q + 1) / p), xg, og, inner, hidden, 1);
        }
    } else {
        for (int e = 0; e < n_experts && !failed; e++)
            failed |= moe_rows(weights, types, first, e, 0, counts[e], xg, og, inner, hidden, threads);
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
static inline __attribute__((always_inline)) void q8_cols(const uint8_t *w, const float *x,
                                                          const int m, int k, float *y,
                                                          int ldy, int n0, int n1) {
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
            q8_any(w, x + (size_t)r0 * K, m, K, y + (size_t)r0 * N, N,
                   (int)((long)N * t / chunks), (int)((long)N * (t + 1) / chunks));
    }
    return 0;
}

/* y[r, n] for r < m (1 <= m <= ROWS) and n0 <= n < n1 (y has row stride ldy), float32 W:
   each a VW-lane dot product over K's whole vectors, reduced in acc_sum's order, then the
   tail (K % VW values) added in order, so a row's result is the same in any batch. */
static void f32_cols(const float *w, const float *x, int m, int k, float *y, int ldy, int n0,
                     int n1) {
    const int kv = k - k % VW;
    for (int n = n0; n < n1; n++) {
        const float *wn = w + (size_t)n * k;
        _mm_prefetch((const char *)(wn + k), _MM_HINT_T0); /* the next row's first line */
        for (int r = 0; r < m; r++) {
            const float *xr = x + (size_t)r * k;
            acc_t a = acc_zero();
            for (int i = 0; i < kv; i += VW) a = v_fmadd(v_load(xr + i), v_load(wn + i), a);
            float s = acc_sum(a);
            for (int i = kv; i < k; i++) s += xr[i] * wn[i];
            y[(size_t)r * ldy + n] = s;
        }
    }
}

/* y [M, N] = x [M, K] @ W.T for a float32 W [N, K], on `threads` threads: a router, a
   shared expert or a head kept in float32 (decoding rows; each row of W is read once for
   ROWS rows of x). 0. */
int bevy_f32_linear(const float *w, const float *x, float *y, int M, int N, int K, int threads) {
    const int chunks = n_chunks(N);
    for (int r0 = 0; r0 < M; r0 += ROWS) {
        int m = M - r0 < ROWS ? M - r0 : ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int t = 0; t < chunks; t++)
            f32_cols(w, x + (size_t)r0 * K, m, K, y + (size_t)r0 * N, N,
                     (int)((long)N * t / chunks), (int)((long)N * (t + 1) / chunks));
    }
    return 0;
}

/* Block b of 16 weight rows as stored (blk: row 0's block, `row` bytes to the next row's)
   into their packed block at c: the 16 f16 d (then Q4_1's 16 m), then the quant bytes as
   four runs of 64, run j holding bytes 4j .. 4j + 3 of each row in row order. In whole
   vectors: with a copy per scale and per 4-byte word, packing bytes already in the CPU's
   cache took four times a memcpy of them, bound by its loads and stores rather than by
   memory (docs/performance.md). Four rows at a time: their four quant words transposed
   (unpack 32 then 64), their first four bytes (d, and Q4_1's m) split into d's and m's. */
static inline void pack_block(const uint8_t *blk, size_t row, int q4_1, uint8_t *c) {
    const int hs = q4_1 ? 4 : 2;
    /* each row's first dword (d | m << 16) to its d's (low 8 bytes) and m's (high 8) */
    const __m128i halves = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m128i heads[4];
    for (int i = 0; i < 4; i++) {
        const uint8_t *r0 = blk + (size_t)(4 * i) * row;
        int32_t h[4];
        for (int r = 0; r < 4; r++) memcpy(&h[r], r0 + (size_t)r * row, 4);
        heads[i] = _mm_shuffle_epi8(_mm_setr_epi32(h[0], h[1], h[2], h[3]), halves);
        const __m128i a0 = _mm_loadu_si128((const __m128i *)(r0 + hs));
        const __m128i a1 = _mm_loadu_si128((const __m128i *)(r0 + row + hs));
        const __m128i a2 = _mm_loadu_si128((const __m128i *)(r0 + 2 * row + hs));
        const __m128i a3 = _mm_loadu_si128((const __m128i *)(r0 + 3 * row + hs));
        const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpackhi_epi32(a0, a1);
        const __m128i t2 = _mm_unpacklo_epi32(a2, a3), t3 = _mm_unpackhi_epi32(a2, a3);
        uint8_t *q = c + 16 * hs + 16 * i;
        _mm_storeu_si128((__m128i *)q, _mm_unpacklo_epi64(t0, t2));
        _mm_storeu_si128((__m128i *)(q + 64), _mm_unpackhi_epi64(t0, t2));
        _mm_storeu_si128((__m128i *)(q + 128), _mm_unpacklo_epi64(t1, t3));
        _mm_storeu_si128((__m128i *)(q + 192), _mm_unpackhi_epi64(t1, t3));
    }
    _mm_storeu_si128((__m128i *)c, _mm_unpacklo_epi64(heads[0], heads[1]));
    _mm_storeu_si128((__m128i *)(c + 16), _mm_unpacklo_epi64(heads[2], heads[3]));
    if (q4_1) {
        _mm_storeu_si128((__m128i *)(c + 32), _mm_unpackhi_epi64(heads[0], heads[1]));
        _mm_storeu_si128((__m128i *)(c + 48), _mm_unpackhi_epi64(heads[2], heads[3]));
    }
}

/* Q4_0 (type 0) or Q4_1 (type 1) weights [n, k] as stored, packed in place by 16 rows for
   the packed kernels (q4p_cols: the same bytes, reordered within each group of 16 rows).
   Returns the packed type code for q4_cols; -1 where the type or shape does not pack (n a
   multiple of 16, k of 32), or memory runs out. The groups are shared out on `threads`
   threads: the engine packs each expert on its own thread as the read lands, between
   products, and two cores read bytes fresh from the disk faster than one. */
int bevy_q4_pack(uint8_t *w, int type, int n, int k, int threads) {
    if ((type != 0 && type != 1) || n % 16 || k % 32 || n <= 0) return -1;
    const int nb = k / 32, bs = type ? 20 : 18;
    const size_t group = (size_t)16 * nb * bs;
    const int groups = n / 16;
    int team = threads > 1 ? threads : 1, next = 0;
    if (team > groups) team = groups;
    uint8_t *tmp = malloc(group * team); /* each thread's copy of the group it packs */
    if (!tmp) return -1;
    /* The groups in shrinking runs (guided), each to whichever thread is free: one that
       the link thread holds up packs fewer instead of keeping the others at the barrier,
       and the first runs are long enough to stream (runs of 4 groups were slower). */
#pragma omp parallel num_threads(team)
    {
        int me;
#pragma omp atomic capture
        me = next++;
        uint8_t *own = tmp + (size_t)me * group;
#pragma omp for schedule(guided)
        for (int g = 0; g < groups; g++) {
            uint8_t *dst = w + (size_t)g * group;
            memcpy(own, dst, group); /* rows 16g .. 16g + 15 as stored: the group's bytes */
            for (int b = 0; b < nb; b++)
                pack_block(own + (size_t)b * bs, (size_t)nb * bs, type, dst + (size_t)b * 16 * bs);
        }
    }
    free(tmp);
    return type ? T_Q41_PACKED : T_Q40_PACKED;
}

/* Packed Q4_0 / Q4_1 weights [n, k] (bevy_q4_pack; type 0 or 1 as before packing) back
   to the blocks as stored, into out (not overlapping w). 0, or -1 for a type or shape
   that bevy_q4_pack does not take. */
int bevy_q4_unpack(const uint8_t *w, uint8_t *out, int type, int n, int k) {
    if ((type != 0 && type != 1) || n % 16 || k % 32 || n <= 0) return -1;
    const int nb = k / 32, bs = type ? 20 : 18, hs = type ? 4 : 2;
    for (int g = 0; g < n / 16; g++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *c = w + ((size_t)g * nb + b) * 16 * bs;
            for (int r = 0; r < 16; r++) {
                uint8_t *blk = out + ((size_t)(16 * g + r) * nb + b) * bs;
                memcpy(blk, c + 2 * r, 2);
                if (type) memcpy(blk + 2, c + 32 + 2 * r, 2);
                for (int j = 0; j < 4; j++) memcpy(blk + hs + 4 * j, c + 16 * hs + 64 * j + 4 * r, 4);
            }
        }
    return 0;
}
