/* The row-local ops of a decoder layer, fused for x86 CPUs with AVX-512: residual add + RMSNorm,
 * rotary embedding, SiLU(gate) * up; and of the head: the float32 rescoring of its leading
 * candidates, and each row's argmax. Each row is computed on its own, in fp32, with reductions
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
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
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
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
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
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
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

/* Keeps vals/idx (n of at most cap, largest first) the cap largest seen; v is larger than the
 * smallest kept once cap are kept, so on equal values the earlier index stays. */
static inline void keep_top(float *vals, long *idx, long *n, long cap, float v, long i) {
    long at = *n < cap ? (*n)++ : cap - 1;
    for (; at > 0 && vals[at - 1] < v; at--) {
        vals[at] = vals[at - 1];
        idx[at] = idx[at - 1];
    }
    vals[at] = v;
    idx[at] = i;
}

static inline float dot_f32(const float *a, const float *b, long d) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(load16(a, i, d, 0), load16(b, i, d, 0), acc);
    return _mm512_reduce_add_ps(acc);
}

#define MAX_RESCORED 64

/* The head's leading candidates in float32 (LlamaForCausalLM.compute_logits): out [m, vocab]
 * float32 is the bf16 logits [m, vocab] widened, with each row's num_top largest (on equal values
 * the lower index) replaced by the dot product, in float32 and a fixed order, of their rows of
 * weight [vocab, d] with the row's hidden [m, d]. One pass over the row instead of torch's
 * widening, topk, gather, product, sum and scatter. */
void faser_rescore_head(const uint16_t *logits, const float *hidden, const float *weight,
                        float *out, long m, long vocab, long d, long num_top) {
    if (num_top > MAX_RESCORED) num_top = MAX_RESCORED;
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
    for (long r = 0; r < m; r++) {
        const uint16_t *row = logits + r * vocab;
        float *o = out + r * vocab, vals[MAX_RESCORED];
        long idx[MAX_RESCORED], n = 0;
        __m512 floor = _mm512_set1_ps(-INFINITY);  /* the smallest kept, once num_top are */
        for (long i = 0; i < vocab; i += 16) {
            __m512 v = load16(row, i, vocab, 1);
            store16(o, i, vocab, v, 0);
            __mmask16 hits = _mm512_cmp_ps_mask(v, floor, _CMP_GT_OQ) & tail_mask(vocab - i);
            while (hits) {
                long lane = __builtin_ctz(hits);
                hits &= hits - 1;
                keep_top(vals, idx, &n, num_top, o[i + lane], i + lane);
                if (n == num_top) {
                    floor = _mm512_set1_ps(vals[n - 1]);
                    hits &= _mm512_cmp_ps_mask(v, floor, _CMP_GT_OQ);
                }
            }
        }
        for (long j = 0; j < n; j++) o[idx[j]] = dot_f32(weight + idx[j] * d, hidden + r * d, d);
    }
}

/* index [m]: the first maximum of each row of x [m, n] float32 (rows without NaN). */
void faser_argmax_rows(const float *x, int64_t *index, long m, long n) {
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
    for (long r = 0; r < m; r++) {
        const float *row = x + r * n;
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (long i = 0; i < n; i += 16)
            best = _mm512_mask_max_ps(best, tail_mask(n - i), best, load16(row, i, n, 0));
        __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
        index[r] = 0;
        for (long i = 0; i < n; i += 16) {
            __mmask16 at = _mm512_cmp_ps_mask(load16(row, i, n, 0), top, _CMP_EQ_OQ) &
                           tail_mask(n - i);
            if (at) {
                index[r] = i + __builtin_ctz(at);
                break;
            }
        }
    }
}
