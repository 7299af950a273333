/* The row-local ops of a decoder layer for x86 CPUs with AVX2 and FMA but no AVX-512, float32
 * only, exported as cpu_ops.c's functions (bf16 = 0): residual add + RMSNorm, rotary embedding,
 * SiLU(gate) * up, and each row's argmax. As in cpu_ops.c, each row is computed on its own, with
 * reductions in a fixed order (eight lanes, then cpu_vec_avx2.h's sum_lanes), so a row gets the
 * same bits whatever else shares the call. The bf16 head's rescoring has no build here: a float32
 * head needs none.
 */
#include "cpu_vec_avx2.h"
#include <math.h>
#include <stdint.h>

/* Elements [i, min(i + 8, n)) of a row, zeros past n. */
static inline __m256 load8(const float *row, long i, long n) {
    if (n - i >= LANES) return _mm256_loadu_ps(row + i);
    return _mm256_maskload_ps(row + i, _mm256_castps_si256(first(n - i)));
}

static inline void store8(float *row, long i, long n, __m256 v) {
    if (n - i >= LANES)
        _mm256_storeu_ps(row + i, v);
    else
        _mm256_maskstore_ps(row + i, _mm256_castps_si256(first(n - i)), v);
}

/* residual_out = x + residual (residual NULL: x), out = RMSNorm(residual_out) * w; all [m, d]. */
void faser_add_rms_norm(const float *x, const float *residual, const float *weight, float *out,
                        float *residual_out, long m, long d, float eps, int bf16, int out_bf16) {
    if (bf16 || out_bf16) return; /* the Python side never asks: cpu_build has no bf16 here */
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
    for (long r = 0; r < m; r++) {
        float *hr = residual_out + r * d;
        __m256 sq = _mm256_setzero_ps();
        for (long i = 0; i < d; i += LANES) {
            __m256 h = load8(x + r * d, i, d);
            if (residual) h = _mm256_add_ps(h, load8(residual + r * d, i, d));
            store8(hr, i, d, h);
            sq = _mm256_fmadd_ps(h, h, sq);
        }
        __m256 s = _mm256_set1_ps(1.0f / sqrtf(sum_lanes(sq) / (float)d + eps));
        for (long i = 0; i < d; i += LANES)
            store8(out + r * d, i, d,
                   _mm256_mul_ps(_mm256_mul_ps(load8(hr, i, d), s), load8(weight, i, d)));
    }
}

/* In place on x [n, heads, head_dim] (rows `row_stride` elements apart): the "rotate half"
 * rotary embedding of Llama checkpoints, cos/sin [max_position, head_dim / 2]. */
void faser_rotary(float *x, const int64_t *positions, const float *cos_table,
                  const float *sin_table, long n, long heads, long head_dim, long row_stride,
                  int bf16) {
    if (bf16) return;
    long half = head_dim / 2;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (long t = 0; t < n; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (long h = 0; h < heads; h++) {
            float *head = x + t * row_stride + h * head_dim, *second = head + half;
            for (long i = 0; i < half; i += LANES) {
                __m256 x1 = load8(head, i, half), x2 = load8(second, i, half);
                __m256 cv = load8(c, i, half), sv = load8(s, i, half);
                store8(head, i, half, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
                store8(second, i, half, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
            }
        }
    }
}

/* out [m, inter] = silu(gate) * up, from gate_up [m, 2 * inter] (gate first). */
void faser_silu_mul(const float *gate_up, float *out, long m, long inter, int bf16) {
    if (bf16) return;
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
    for (long r = 0; r < m; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        for (long i = 0; i < inter; i += LANES) {
            __m256 gv = load8(g, i, inter);
            __m256 silu = _mm256_div_ps(
                gv, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                  exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            store8(out + r * inter, i, inter, _mm256_mul_ps(silu, load8(u, i, inter)));
        }
    }
}

/* index [m]: the first maximum of each row of x [m, n] (rows without NaN). */
void faser_argmax_rows(const float *x, int64_t *index, long m, long n) {
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
    for (long r = 0; r < m; r++) {
        const float *row = x + r * n;
        __m256 best = _mm256_set1_ps(-INFINITY);
        for (long i = 0; i < n; i += LANES)
            best = _mm256_blendv_ps(best, _mm256_max_ps(best, load8(row, i, n)), first(n - i));
        float lanes[LANES], top;
        _mm256_storeu_ps(lanes, best);
        top = lanes[0];
        for (int l = 1; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
        index[r] = 0;
        for (long i = 0; i < n; i++)
            if (row[i] == top) {
                index[r] = i;
                break;
            }
    }
}
