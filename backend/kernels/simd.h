/* SIMD helpers shared by the native kernels (q4_matmul.c, attention.c), which
 * backend/kernels/native.py compiles together into one library.
 *
 * acc_t is the widest float vector the build targets (AVX-512: 16 lanes, else AVX2: 8),
 * VW its lane count, v_* its element-wise operations. Each horizontal reduction adds (or
 * compares) the lanes in one fixed order, so its result depends only on the vector it is
 * given. Build with -ffp-contract=off: a scalar multiply-add is then never fused in one
 * place and not another.
 */
#ifndef BEVY_SIMD_H
#define BEVY_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the native Q4 kernels need AVX2, FMA and F16C"
#endif

/* The f16 at p (a block's scale), widened to float. */
static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* n floats (a multiple of 8) at x to float16 at h, rounded to nearest even as torch's
   float-to-half conversion rounds, so either side may write a cache the other reads. */
static inline void f32_to_f16(const float *x, uint16_t *h, int n) {
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

#ifdef __AVX512F__
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(acc_t a) { return _mm512_reduce_add_ps(a); }
#define VW 16
#define v_load _mm512_loadu_ps
#define v_set1 _mm512_set1_ps
#define v_fmadd _mm512_fmadd_ps
#define v_fnmadd _mm512_fnmadd_ps
#define v_mul _mm512_mul_ps
#define v_add _mm512_add_ps
#define v_max _mm512_max_ps
#define v_store _mm512_storeu_ps
/* VW float16 values at p (a KV cache row), widened to float. */
static inline acc_t v_loadh(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
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
typedef __m256 acc_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline float acc_sum(acc_t a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}
#define VW 8
#define v_load _mm256_loadu_ps
#define v_set1 _mm256_set1_ps
#define v_fmadd _mm256_fmadd_ps
#define v_fnmadd _mm256_fnmadd_ps
#define v_mul _mm256_mul_ps
#define v_add _mm256_add_ps
#define v_max _mm256_max_ps
#define v_store _mm256_storeu_ps
static inline acc_t v_loadh(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
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

#endif /* BEVY_SIMD_H */
