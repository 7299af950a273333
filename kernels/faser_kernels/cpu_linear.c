/* Row-invariant linear layers for x86 CPUs with AVX-512: out[m, n] = x[m, :] . w[n, :] + b[n].
 *
 * Every output element is one fp32 accumulator that walks k in the same order whatever the
 * number of rows M, the row's place in the batch or the thread that computes it, so row m of an
 * M-row call has the bits of a one-row call (speculation is then exact by construction). The
 * weight is packed once into column panels of PANEL outputs, each a k-major stream read once per
 * call (a decode step is bound by reading the weights):
 *   bf16: [num_panels, K / 2, PANEL, 2] (k pairs, as vdpbf16ps takes them)
 *   fp32: [num_panels, K, PANEL]
 *   int8: as bf16, with a float32 scale per output (a draft's weights: half the bytes to stream)
 * Each panel is multiplied with up to MAX_ROWS rows at a time, all held in registers. An int8
 * weight is widened to bf16 in registers (every int8 is exact in bf16) and its scale applied
 * once per output, after the sum, so the sum walks k as the bf16 kernel's does.
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 32
#define MAX_ROWS 12

typedef struct {
    const void *x;      /* [M, K] bf16 or fp32, rows contiguous */
    const void *w;      /* packed, see above */
    const float *scale; /* [N] for an int8 weight, else NULL */
    const float *bias;  /* [N] or NULL */
    void *out;          /* [M, N] bf16 or fp32 */
    long m, n, k;
} Linear;

static inline void store_panel(const Linear *a, long row, long n0, __m512 lo, __m512 hi,
                               int bf16_out) {
    long left = a->n - n0;
    __mmask16 mlo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    __mmask16 mhi = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    if (a->scale) {
        lo = _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mlo, a->scale + n0));
        hi = _mm512_mul_ps(hi, _mm512_maskz_loadu_ps(mhi, a->scale + n0 + 16));
    }
    if (a->bias) {
        lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(mlo, a->bias + n0));
        hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(mhi, a->bias + n0 + 16));
    }
    if (bf16_out) {
        uint16_t *out = (uint16_t *)a->out + row * a->n + n0;
        _mm256_mask_storeu_epi16(out, mlo, (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_mask_storeu_epi16(out + 16, mhi, (__m256i)_mm512_cvtneps_pbh(hi));
    } else {
        float *out = (float *)a->out + row * a->n + n0;
        _mm512_mask_storeu_ps(out, mlo, lo);
        _mm512_mask_storeu_ps(out + 16, mhi, hi);
    }
}

/* 16 int8 (8 outputs' k pairs) as 16 floats. */
static inline __m512 widen_i8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

/* Rows [m0, m0 + ROWS) of panel p of a bf16 (INT8 0) or int8 (INT8 1) weight, both taken as bf16
 * k-pairs; ROWS and INT8 are constants in every call, so acc lives in registers. */
static inline __attribute__((always_inline)) void panel_pairs(const Linear *a, long p, long m0,
                                                              const int ROWS, const int INT8) {
    __m512 acc[MAX_ROWS][2];
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const char *w = (const char *)a->w + p * a->k * PANEL * (INT8 ? 1 : 2);
    const uint16_t *x = (const uint16_t *)a->x + m0 * a->k;
    for (long kp = 0; kp < a->k / 2; kp++) {
        __m512bh w0, w1;
        if (INT8) {
            __m512i q = _mm512_loadu_si512(w + kp * 2 * PANEL);
            w0 = _mm512_cvtne2ps_pbh(widen_i8(_mm512_extracti32x4_epi32(q, 1)),
                                     widen_i8(_mm512_castsi512_si128(q)));
            w1 = _mm512_cvtne2ps_pbh(widen_i8(_mm512_extracti32x4_epi32(q, 3)),
                                     widen_i8(_mm512_extracti32x4_epi32(q, 2)));
        } else {
            w0 = (__m512bh)_mm512_loadu_si512(w + kp * 4 * PANEL);
            w1 = (__m512bh)_mm512_loadu_si512(w + kp * 4 * PANEL + 2 * PANEL);
        }
        for (int i = 0; i < ROWS; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + i * a->k + 2 * kp));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
        }
    }
    for (int i = 0; i < ROWS; i++) store_panel(a, m0 + i, p * PANEL, acc[i][0], acc[i][1], 1);
}

static inline __attribute__((always_inline)) void panel_bf16(const Linear *a, long p, long m0,
                                                             const int ROWS) {
    panel_pairs(a, p, m0, ROWS, 0);
}

static inline __attribute__((always_inline)) void panel_i8(const Linear *a, long p, long m0,
                                                           const int ROWS) {
    panel_pairs(a, p, m0, ROWS, 1);
}

static inline __attribute__((always_inline)) void panel_f32(const Linear *a, long p, long m0,
                                                            const int ROWS) {
    __m512 acc[MAX_ROWS][2];
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const float *w = (const float *)a->w + p * a->k * PANEL;
    const float *x = (const float *)a->x + m0 * a->k;
    for (long k = 0; k < a->k; k++) {
        __m512 w0 = _mm512_loadu_ps(w + k * PANEL);
        __m512 w1 = _mm512_loadu_ps(w + k * PANEL + 16);
        for (int i = 0; i < ROWS; i++) {
            __m512 xb = _mm512_set1_ps(x[i * a->k + k]);
            acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < ROWS; i++) store_panel(a, m0 + i, p * PANEL, acc[i][0], acc[i][1], 0);
}

#define DISPATCH(fn, a, p, m0, rows)                                                               \
    switch (rows) {                                                                                \
    case 1: fn(a, p, m0, 1); break;                                                                \
    case 2: fn(a, p, m0, 2); break;                                                                \
    case 3: fn(a, p, m0, 3); break;                                                                \
    case 4: fn(a, p, m0, 4); break;                                                                \
    case 5: fn(a, p, m0, 5); break;                                                                \
    case 6: fn(a, p, m0, 6); break;                                                                \
    case 7: fn(a, p, m0, 7); break;                                                                \
    case 8: fn(a, p, m0, 8); break;                                                                \
    case 9: fn(a, p, m0, 9); break;                                                                \
    case 10: fn(a, p, m0, 10); break;                                                              \
    case 11: fn(a, p, m0, 11); break;                                                              \
    default: fn(a, p, m0, 12); break;                                                              \
    }

enum { F32, BF16, I8 };

static void run(const Linear *a, int format) {
    long num_panels = (a->n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < num_panels; p++) {
        for (long m0 = 0; m0 < a->m; m0 += MAX_ROWS) {
            long rows = a->m - m0 < MAX_ROWS ? a->m - m0 : MAX_ROWS;
            if (format == BF16) {
                DISPATCH(panel_bf16, a, p, m0, rows);
            } else if (format == I8) {
                DISPATCH(panel_i8, a, p, m0, rows);
            } else {
                DISPATCH(panel_f32, a, p, m0, rows);
            }
        }
    }
}

void faser_linear_bf16(const void *x, const void *w, const float *bias, void *out, long m,
                       long n, long k) {
    Linear a = {x, w, NULL, bias, out, m, n, k};
    run(&a, BF16);
}

void faser_linear_f32(const void *x, const void *w, const float *bias, void *out, long m, long n,
                      long k) {
    Linear a = {x, w, NULL, bias, out, m, n, k};
    run(&a, F32);
}

/* x bf16, w int8 panels with a scale per output; out bf16. */
void faser_linear_i8(const void *x, const void *w, const float *scale, const float *bias,
                     void *out, long m, long n, long k) {
    Linear a = {x, w, scale, bias, out, m, n, k};
    run(&a, I8);
}
