/* Decoding attention: one new token per sequence, float32 or float16 KV cache
 * (bevy_attn_decode), and
 * a decoding step's whole attention block around it (bevy_attn_block). Compiled with
 * q4_matmul.c into one library by backend/kernels/native.py (see there for why).
 *
 * Every row is computed on its own, in chunks of positions merged in position order, so a
 * row's result depends neither on its batch-mates nor on the number of threads. Build
 * with -ffp-contract=off, as q4_matmul.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Positions per work item. Fixed, so a row's result depends neither on the number of
   threads nor on its batch-mates: each item's partial softmax is merged in position order. */
#define ATT_CHUNK 256
#define ATT_MAX_REP 16 /* query heads per kv head the kernel takes (callers check) */

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

/* Query heads that one pass over a chunk's keys or values takes together: as many as keep
   their queries, or their accumulators, in half the vector registers (dh / VW each). Each
   key and value row is then read from memory once for all of them, not once a head. */
#ifdef __AVX512F__
#define ATT_REGS 16
#else
#define ATT_REGS 8
#endif
#define ATT_HEADS(nv) ((nv) >= ATT_REGS ? 1 : ATT_REGS / (nv))
/* Bytes of keys ahead of the score loop that it asks the CPU for, with the values of the
   row it scores (for the pass over them that follows): a kv head's rows are one run of
   bytes, which the hardware prefetcher restarts at every 4 KiB page. */
#define ATT_AHEAD 2048

/* One work item: the `rep` query heads q [rep, dh] of one kv head against its keys and
   values K, V [*, dh] at positions j0 <= j < j1. Writes, per head i, the chunk's score
   maximum m, sum l of exp(score - m) and acc [dh] = sum of exp(score - m) * v, to
   out + i * (dh + 2) as (acc, m, l). K and V hold float16 if half, else float32. Inlined
   with dh and half constants (64, 128; 0, 1) so that a head's dh / VW accumulators stay in
   registers and each load is one kind. A head's operations, and their order, are the
   same whichever heads share its pass. */
#define KV_LOAD(p, at) (half ? v_loadh((const uint16_t *)(p) + (at)) : v_load((const float *)(p) + (at)))
static inline __attribute__((always_inline)) void attn_chunk_dh(const float *q, int rep,
                                                                const int dh, const int half,
                                                                const void *K, const void *V,
                                                                int j0, int j1, float scale,
                                                                float *out) {
    float s[ATT_MAX_REP][ATT_CHUNK + VW];
    const int n = j1 - j0, npad = (n + VW - 1) / VW * VW, nv = dh / VW, hb = ATT_HEADS(nv);
    const int row = dh * (half ? 2 : 4), ahead = (ATT_AHEAD + row - 1) / row;
    const char *kb = (const char *)K, *vb = (const char *)V;
    for (int i0 = 0; i0 < rep; i0 += hb) {
        const int nh = rep - i0 < hb ? rep - i0 : hb;
        acc_t qv[256 / VW]; /* nh * nv of them */
        for (int i = 0; i < nh; i++)
            for (int d = 0; d < nv; d++) qv[i * nv + d] = v_load(q + (size_t)(i0 + i) * dh + d * VW);
        for (int j = 0; j < n; j++) {
            const size_t kj = (size_t)(j0 + j) * dh;
            if (i0 == 0)
                for (int c = 0; c < row; c += 64) {
                    _mm_prefetch(kb + (size_t)(j0 + j + ahead) * row + c, _MM_HINT_T0);
                    _mm_prefetch(vb + (size_t)(j0 + j) * row + c, _MM_HINT_T1);
                }
            for (int i = 0; i < nh; i++) {
                const acc_t *qi = qv + i * nv;
                acc_t a = v_mul(qi[0], KV_LOAD(K, kj)), b = acc_zero();
                if (nv > 1) b = v_mul(qi[1], KV_LOAD(K, kj + VW));
                for (int d = 2; d < nv; d += 2) {
                    a = v_fmadd(qi[d], KV_LOAD(K, kj + d * VW), a);
                    if (d + 1 < nv) b = v_fmadd(qi[d + 1], KV_LOAD(K, kj + (d + 1) * VW), b);
                }
                s[i0 + i][j] = acc_sum(v_add(a, b)) * scale;
            }
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
        o[dh] = m;
        o[dh + 1] = l;
    }
    for (int i0 = 0; i0 < rep; i0 += hb) {
        const int nh = rep - i0 < hb ? rep - i0 : hb;
        acc_t acc[256 / VW]; /* nh * nv of them */
        for (int i = 0; i < nh * nv; i++) acc[i] = acc_zero();
        for (int j = 0; j < n; j++) {
            const size_t vj = (size_t)(j0 + j) * dh;
            for (int d = 0; d < nv; d++) {
                const acc_t v = KV_LOAD(V, vj + d * VW);
                for (int i = 0; i < nh; i++)
                    acc[i * nv + d] = v_fmadd(v_set1(s[i0 + i][j]), v, acc[i * nv + d]);
            }
        }
        for (int i = 0; i < nh; i++)
            for (int d = 0; d < nv; d++)
                v_store(out + (size_t)(i0 + i) * (dh + 2) + d * VW, acc[i * nv + d]);
    }
}

#undef KV_LOAD

static void attn_chunk(const float *q, int rep, int dh, int half, const void *K, const void *V,
                       int j0, int j1, float scale, float *out) {
    if (half) switch (dh) {
        case 64: attn_chunk_dh(q, rep, 64, 1, K, V, j0, j1, scale, out); break;
        case 128: attn_chunk_dh(q, rep, 128, 1, K, V, j0, j1, scale, out); break;
        default: attn_chunk_dh(q, rep, dh, 1, K, V, j0, j1, scale, out); break; /* dh <= 256 */
        }
    else switch (dh) {
        case 64: attn_chunk_dh(q, rep, 64, 0, K, V, j0, j1, scale, out); break;
        case 128: attn_chunk_dh(q, rep, 128, 0, K, V, j0, j1, scale, out); break;
        default: attn_chunk_dh(q, rep, dh, 0, K, V, j0, j1, scale, out); break;
        }
}

/* Attention of T sequences' new tokens (one each), heads grouped over G kv heads (H / G
   query heads each, at most ATT_MAX_REP; dh a multiple of 16 up to 256).

   Row r: queries q + r * ldq [H, dh] (RoPE applied), its new key and value
   k + r * ldk, v + r * ldv [G, dh], its cache kbuf[r], vbuf[r] [G, caps[r], dh] (float16
   if kv_half, else float32; capacity caps[r] > pos[r]). The new key and value are written
   at position pos[r] (rounded to float16 by f32_to_f16 if kv_half), then
   out [T, H * dh] = softmax(q . K[lo..pos] * scale) V per head, lo = 0, or with a sliding
   window > 0, the first of the last `window` positions: max(0, pos - window + 1). Work
   items are (row, kv head, chunk of ATT_CHUNK positions from lo), merged per head in
   position order. On `threads` threads; 0 on success, -1 if out of memory, -2 for head
   counts or widths it does not take. */
#define ATT_LO(p) (window > 0 && (p) >= window ? (p) - window + 1 : 0)
#define ATT_NCH(p) (((p) - ATT_LO(p) + ATT_CHUNK) / ATT_CHUNK)
int bevy_attn_decode(const float *q, int ldq, const float *k, int ldk, const float *v, int ldv,
                     const uint64_t *kbuf, const uint64_t *vbuf, const int *caps, const int *pos,
                     int T, int H, int G, int dh, float scale, int window, int kv_half,
                     float *out, int threads) {
    if (G <= 0 || H % G || H / G > ATT_MAX_REP || dh % 16 || dh > 256) return -2;
    const int rep = H / G;
    int *first = malloc(sizeof(int) * (size_t)(T + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int r = 0; r < T; r++) first[r + 1] = first[r] + G * ATT_NCH(pos[r]);
    const int items = first[T];
    float *part = malloc(sizeof(float) * (size_t)items * rep * (dh + 2) + 1);
    if (!part) {
        free(first);
        return -1;
    }
    for (int r = 0; r < T; r++)
        for (int g = 0; g < G; g++) {
            size_t at = ((size_t)g * caps[r] + pos[r]) * dh;
            const float *kr = k + (size_t)r * ldk + (size_t)g * dh;
            const float *vr = v + (size_t)r * ldv + (size_t)g * dh;
            if (kv_half) {
                f32_to_f16(kr, (uint16_t *)kbuf[r] + at, dh);
                f32_to_f16(vr, (uint16_t *)vbuf[r] + at, dh);
            } else {
                memcpy((float *)kbuf[r] + at, kr, sizeof(float) * dh);
                memcpy((float *)vbuf[r] + at, vr, sizeof(float) * dh);
            }
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int it = 0; it < items; it++) {
        int r = 0;
        while (first[r + 1] <= it) r++;
        const int nch = ATT_NCH(pos[r]), g = (it - first[r]) / nch;
        const int c = (it - first[r]) % nch, len = pos[r] + 1;
        const int j0 = ATT_LO(pos[r]) + c * ATT_CHUNK;
        const int j1 = j0 + ATT_CHUNK < len ? j0 + ATT_CHUNK : len;
        const size_t base = (size_t)g * caps[r] * dh * (kv_half ? 2 : 4);
        attn_chunk(q + (size_t)r * ldq + (size_t)g * rep * dh, rep, dh, kv_half,
                   (const char *)kbuf[r] + base, (const char *)vbuf[r] + base, j0, j1, scale,
                   part + (size_t)it * rep * (dh + 2));
    }
    for (int r = 0; r < T; r++) {
        const int nch = ATT_NCH(pos[r]);
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
#undef ATT_LO
#undef ATT_NCH

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
   attention as in bevy_attn_decode (`window` and `kv_half` too). Weights in blocks of qkv_type / o_type (linear_any).
   Then, if ffn_w is given, the MoE's input xout [T, D] = rms_norm(out) * ffn_w, and if
   router [E, D] (float32, D a multiple of 16) is given too, its logits [T, E] = xout @
   router.T, each a dot product in a fixed order; and if ids is given too, each row's
   routing (route_top_k: k experts, norm_topk, into ids [T, k] and weights [T, k]). 0 on
   success, -1 if out of memory, -2 as bevy_attn_decode. */
int bevy_attn_block(const float *h, int T, int D, const float *norm_w, float eps,
                    const uint8_t *wqkv, int qkv_type, const uint8_t *wo, int o_type,
                    const float *cos, const float *sin, int interleaved, const uint64_t *kbuf,
                    const uint64_t *vbuf, const int *caps, const int *pos, int H, int G, int dh,
                    float scale, int window, int kv_half, float *out, const float *ffn_w,
                    float *xout, const float *router, int E, float *logits, int k, int norm_topk,
                    int64_t *ids, float *weights, int threads) {
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
                              width, kbuf, vbuf, caps, pos, T, H, G, dh, scale, window, kv_half,
                              att, threads);
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
