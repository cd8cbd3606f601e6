/* A decoding group's walk through the layers in one call, for as long as every expert it
 * routes to is resident (bevy_decode_run). Compiled with q4_matmul.c and attention.c into
 * one library by backend/kernels/native.py (see there for why).
 *
 * When nothing is missing there is nothing for runahead to overlap, and the engine's
 * Python between two layers' kernels (scheduling, claims, the calls themselves) is then
 * pure cost: a third of a decoding step for one request on the demo. This runs the same
 * kernels the engine calls layer by layer, with the same arguments in the same order, so
 * every value is the same bits; it only leaves out the Python between them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* One layer's MoE for T rows whose routing is ids, w [T, K]: the experts in ascending
   order, each with its routes in ascending order (route i is row i / K), into
   y [T, D] = sum of w * expert(x), as the engine's native expert backend orders them. */
static int layer_moe(const bevy_decode_args *a, int l, const float *x, const int64_t *ids,
                     const float *w, float *y, int *cnt, int *routes, uint64_t *weights,
                     int *types, int *counts, int threads) {
    const int n = a->T * a->K, E = a->E;
    memset(cnt, 0, sizeof(int) * (size_t)(E + 1));
    for (int i = 0; i < n; i++) cnt[ids[i] + 1]++;
    int used = 0;
    for (int e = 0; e < E; e++) {
        if (cnt[e + 1]) {
            const uint64_t *t = a->table + ((size_t)l * E + e) * 4;
            weights[3 * used] = t[0];
            weights[3 * used + 1] = t[1];
            weights[3 * used + 2] = t[2];
            types[used] = (int)t[3];
            counts[used++] = cnt[e + 1];
        }
        cnt[e + 1] += cnt[e]; /* cnt[e]: where expert e's routes start */
    }
    for (int i = 0; i < n; i++) routes[cnt[ids[i]]++] = i; /* ascending within each expert */
    memset(y, 0, sizeof(float) * (size_t)a->T * a->D);
    return bevy_q4_moe(weights, types, counts, used, routes, w, a->K, x, y, NULL, a->T, a->inner,
                       a->D, threads);
}

/* Whether every expert that ids [T, K] routes to in layer l is resident. */
static int resident(const bevy_decode_args *a, int l, const int64_t *ids) {
    for (int i = 0; i < a->T * a->K; i++) {
        const int64_t e = ids[i];
        if (e < 0 || e >= a->E || !a->table[((size_t)l * a->E + e) * 4]) return 0;
    }
    return 1;
}

/* The attention block of layer l (bevy_attn_block) on rows h [T, D]: out, x, ids, w. */
static int layer_attention(const bevy_decode_args *a, int l, const float *h, float *out,
                           float *x, float *logits, int64_t *ids, float *w, int threads) {
    const uint64_t *p = a->layers + (size_t)l * 5;
    const int *q = a->layer_ints + (size_t)l * 4;
    const size_t at = (size_t)l * a->T;
    return bevy_attn_block(h, a->T, a->D, (const float *)p[0], a->eps, (const uint8_t *)p[1], q[0],
                           (const uint8_t *)p[2], q[1], a->cos, a->sin, a->interleaved,
                           a->kbuf + at, a->vbuf + at, a->caps + at, a->pos, a->H, a->G, a->dh,
                           a->scale, q[2], a->kv_half, out, (const float *)p[3], x,
                           (const float *)p[4], a->E, logits, a->K, a->norm_topk, ids, w, threads);
}

/* T decoding rows, each before the MoE of layer l0 (h: the residual after its attention,
   x: the MoE's input, ids / w: its routing, all in and out): each layer's MoE, the
   residual, then the next layer's attention block and routing, layer after layer, until
   a layer routes to an expert that is not resident (table), a layer is not taken (its
   layer_ints[4 l + 3] is 0: not routed experts alone; or layers[5 l] is 0: no attention
   block), *stop is set, or the last layer is done. Returns the layer the rows stopped
   before (its h, x, ids and w are then in the buffers; l0 if nothing ran), or L with h
   the last layer's output; trail [L, T, K] gets the routing of each layer entered after
   l0. -1 if out of memory, -2 for arguments the kernels do not take. */
int bevy_decode_run(const bevy_decode_args *a, int l0, float *h, float *x, int64_t *ids,
                    float *w, int64_t *trail, int threads) {
    const size_t TD = (size_t)a->T * a->D, TK = (size_t)a->T * a->K;
    float *buf = malloc(sizeof(float) * (2 * TD + (size_t)a->T * a->E + TK) + 1);
    int *ints = malloc(sizeof(int) * (2 * (size_t)a->E + 2 * TK + 2) + 1);
    uint64_t *weights = malloc(sizeof(uint64_t) * 3 * TK + 1);
    int64_t *ids2 = malloc(sizeof(int64_t) * TK + 1);
    if (!buf || !ints || !weights || !ids2) {
        free(buf);
        free(ints);
        free(weights);
        free(ids2);
        return -1;
    }
    float *y = buf, *out = buf + TD, *logits = out + TD, *w2 = logits + (size_t)a->T * a->E;
    int *cnt = ints, *routes = cnt + a->E + 1, *types = routes + TK, *counts = types + TK;
    int l = l0, rc = 0;
    while (l < a->L) {
        if (!a->layer_ints[(size_t)l * 4 + 3] || !resident(a, l, ids)) break;
        if (l + 1 < a->L && !a->layers[(size_t)(l + 1) * 5]) break;
        if (l > l0 && *a->stop) break;
        rc = layer_moe(a, l, x, ids, w, y, cnt, routes, weights, types, counts, threads);
        if (rc) break;
        for (size_t i = 0; i < TD; i++) y[i] = h[i] + y[i];
        if (l + 1 == a->L) {
            memcpy(h, y, sizeof(float) * TD);
            l = a->L;
            break;
        }
        rc = layer_attention(a, l + 1, y, out, x, logits, ids2, w2, threads);
        if (rc) break;
        memcpy(h, out, sizeof(float) * TD);
        memcpy(ids, ids2, sizeof(int64_t) * TK);
        memcpy(w, w2, sizeof(float) * TK);
        memcpy(trail + (size_t)(l + 1) * TK, ids2, sizeof(int64_t) * TK);
        l++;
    }
    free(buf);
    free(ints);
    free(weights);
    free(ids2);
    return rc ? rc : l;
}
