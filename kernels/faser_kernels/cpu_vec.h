/* AVX-512 helpers shared by the CPU kernels: masked loads and stores of bf16 or fp32 rows as fp32
 * vectors, and a deterministic vector exp. */
#ifndef FASER_CPU_VEC_H
#define FASER_CPU_VEC_H

#include <immintrin.h>
#include <stdint.h>

static inline __mmask16 tail_mask(long left) {
    return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
}

/* 16 elements from i of a row of the given dtype, as fp32 (zeros past n). */
static inline __m512 load16(const void *row, long i, long n, int bf16) {
    __mmask16 m = tail_mask(n - i);
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)row + i);
}

/* 16 fp32 values to elements i.. of a row of the given dtype (bf16: round to nearest even). */
static inline void store16(void *row, long i, long n, __m512 v, int bf16) {
    __mmask16 m = tail_mask(n - i);
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)row + i, m, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)row + i, m, v);
}

/* exp(x) = 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6; x clamped to
 * [-87, 88]. The same bits for the same x on every call: no library or table is involved. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
