/* The row-local ops of a decoder layer, fused for x86 CPUs with AVX-512: residual add + RMSNorm,
 * rotary embedding, SiLU(gate) * up. Each row is computed on its own, in fp32, with reductions
 * in a fixed order, so a row gets the same bits whatever else shares the call; bf16 rows are
 * rounded once per output (round to nearest even). One call each replaces the handful of torch
 * ops (and their dispatch) that each of these takes.
 */
#include "cpu_vec.h"
#include <math.h>
#include <stdint.h>

/* As the dtype rounds it: the normed row is rounded to bf16 before its weight, as torch's
 * reference does. */
static inline __m512 round_to(__m512 v, int bf16) {
    if (!bf16) return v;
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline char *row_at(void *base, long row, long stride, int bf16) {
    return (char *)base + row * stride * (bf16 ? 2 : 4);
}

/* residual_out = x + residual (residual None: x), out = RMSNorm(residual_out) * w. The residual
 * stream is float32 whatever the model's dtype (a bf16 stream rounds at every layer, and the
 * rounding builds up over depth); x and weight are in the model's dtype, out in bf16 or float32
 * (out_bf16); all [m, d]. */
void faser_add_rms_norm(const void *x, const float *residual, const void *weight, void *out,
                        float *residual_out, long m, long d, float eps, int bf16, int out_bf16) {
#pragma omp parallel for schedule(static) if (m > 1)
    for (long r = 0; r < m; r++) {
        const void *xr = row_at((void *)x, r, d, bf16);
        float *hr = residual_out + r * d;
        __m512 sq = _mm512_setzero_ps();
        for (long i = 0; i < d; i += 16) {
            __m512 h = load16(xr, i, d, bf16);
            if (residual) h = _mm512_add_ps(h, load16(residual + r * d, i, d, 0));
            store16(hr, i, d, h, 0);
            sq = _mm512_fmadd_ps(h, h, sq);
        }
        float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)d + eps);
        __m512 s = _mm512_set1_ps(scale);
        for (long i = 0; i < d; i += 16) {
            __m512 normed = round_to(_mm512_mul_ps(load16(hr, i, d, 0), s), out_bf16);
            store16(row_at(out, r, d, out_bf16), i, d,
                    _mm512_mul_ps(normed, load16(weight, i, d, bf16)), out_bf16);
        }
    }
}

/* In place on x [n, heads, head_dim] (rows `row_stride` elements apart): the "rotate half"
 * rotary embedding of Llama checkpoints, cos/sin [max_position, head_dim / 2] fp32. */
void faser_rotary(void *x, const int64_t *positions, const float *cos_table,
                  const float *sin_table, long n, long heads, long head_dim, long row_stride,
                  int bf16) {
    long half = head_dim / 2;
#pragma omp parallel for schedule(static) if (n > 1)
    for (long t = 0; t < n; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (long h = 0; h < heads; h++) {
            char *head = row_at(x, t, row_stride, bf16) + h * head_dim * (bf16 ? 2 : 4);
            char *second = head + half * (bf16 ? 2 : 4);
            for (long i = 0; i < half; i += 16) {
                __m512 x1 = load16(head, i, half, bf16), x2 = load16(second, i, half, bf16);
                __m512 cv = load16(c, i, half, 0), sv = load16(s, i, half, 0);
                store16(head, i, half, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)), bf16);
                store16(second, i, half, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)), bf16);
            }
        }
    }
}

/* out [m, inter] = silu(gate) * up, from gate_up [m, 2 * inter] (gate first). */
void faser_silu_mul(const void *gate_up, void *out, long m, long inter, int bf16) {
#pragma omp parallel for schedule(static) if (m > 1)
    for (long r = 0; r < m; r++) {
        const char *g = row_at((void *)gate_up, r, 2 * inter, bf16);
        const char *u = g + inter * (bf16 ? 2 : 4);
        for (long i = 0; i < inter; i += 16) {
            __m512 gv = load16(g, i, inter, bf16);
            __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                          exp512(_mm512_sub_ps(
                                                              _mm512_setzero_ps(), gv))));
            store16(row_at(out, r, inter, bf16), i, inter,
                    _mm512_mul_ps(round_to(silu, bf16), load16(u, i, inter, bf16)), bf16);
        }
    }
}
