/* The functions the native library exports (q4_matmul.c, attention.c, decode.c). Their signatures
 * are the ctypes argtypes that backend/kernels/native.py sets: change both together.
 * Each returns 0 on success, -1 if out of memory and (attention) -2 for arguments it does
 * not take; see each definition for what it computes.
 */
#ifndef BEVY_KERNELS_H
#define BEVY_KERNELS_H

#include <stdint.h>

/* q4_matmul.c */
int bevy_q4_linear(const uint8_t *w, int type, const float *x, float *y, int M, int N, int K,
                   int threads);
int bevy_q4_expert_mlp(const uint8_t *gate, const uint8_t *up, const uint8_t *down, int types,
                       const float *x, float *out, int M, int inner, int hidden, int threads);
int bevy_q4_moe(const uint64_t *weights, const int *types, const int *counts, int n_experts,
                const int *routes, const float *route_w, int k, const float *x, float *y,
                float *parts, int sum_rows, int inner, int hidden, int threads);
int bevy_q8_linear(const uint8_t *w, const float *x, float *y, int M, int N, int K, int threads);
int bevy_f32_linear(const float *w, const float *x, float *y, int M, int N, int K, int threads);
int bevy_q4_pack(uint8_t *w, int type, int n, int k, int threads);
int bevy_q4_unpack(const uint8_t *w, uint8_t *out, int type, int n, int k);

/* attention.c */
int bevy_attn_decode(const float *q, int ldq, const float *k, int ldk, const float *v, int ldv,
                     const uint64_t *kbuf, const uint64_t *vbuf, const int *caps, const int *pos,
                     int T, int H, int G, int dh, float scale, int window, int kv_half,
                     float *out, int threads);
int bevy_attn_block(const float *h, int T, int D, const float *norm_w, float eps,
                    const uint8_t *wqkv, int qkv_type, const uint8_t *wo, int o_type,
                    const float *cos, const float *sin, int interleaved, const uint64_t *kbuf,
                    const uint64_t *vbuf, const int *caps, const int *pos, int H, int G, int dh,
                    float scale, int window, int kv_half, float *out, const float *ffn_w,
                    float *xout, const float *router, int E, float *logits, int k, int norm_topk,
                    int64_t *ids, float *weights, int threads);

/* decode.c: what bevy_decode_run needs besides the rows; native.DecodeArgs mirrors it. */
typedef struct {
    int T, D, L, K, E, H, G, dh, inner, interleaved, norm_topk;
    int kv_half;              /* the K and V buffers hold float16 (else float32) */
    float eps, scale;
    const uint64_t *table;    /* [L, E, 4]: an expert's gate, up, down addresses and types
                                 (the kernels' bits); gate 0: not resident */
    const uint64_t *layers;   /* [L, 5]: norm, qkv, output, FFN norm, router (0: no block) */
    const int *layer_ints;    /* [L, 4]: qkv type, output type, window, MoE taken (0 / 1) */
    const float *cos, *sin;   /* RoPE tables [*, dh / 2] by position */
    const uint64_t *kbuf, *vbuf; /* [L, T] each row's K and V buffers per layer */
    const int *caps;          /* [L, T] their capacities */
    const int *pos;           /* [T] each row's position */
    const volatile int *stop; /* set by another thread: stop at the next layer */
} bevy_decode_args;
int bevy_decode_run(const bevy_decode_args *a, int l0, float *h, float *x, int64_t *ids,
                    float *w, int64_t *trail, int threads);

#endif /* BEVY_KERNELS_H */
