/* Row-invariant float32 linear layers for x86 CPUs with AVX2 and FMA but no AVX-512:
 * out[m, n] = x[m, :] . w[n, :] + b[n], exported as cpu_linear.c's faser_linear_f32.
 *
 * The same contract and weight layout as cpu_linear.c's float32 path ([num_panels, K, PANEL],
 * packed by cpu_linear.pack_weight): every output element is one fp32 accumulator that walks k
 * in order, whatever the number of rows, the row's place in the batch or the thread, so row m of
 * an M-row call has the bits of a one-row call. A panel's 32 outputs are four 8-wide vectors;
 * MAX_ROWS rows of them (twelve accumulators) and a broadcast fit AVX2's sixteen registers, the
 * panel's vectors being read as the FMAs' memory operands. Rows past MAX_ROWS take the panel
 * again, from the cache it was just read into.
 */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#define PANEL 32
#define MAX_ROWS 3

typedef struct {
    const float *x;    /* [M, K], rows contiguous */
    const float *w;    /* [num_panels, K, PANEL] */
    const float *bias; /* [N] or NULL */
    float *out;        /* [M, N] */
    long m, n, k;
} Linear;

static inline void store_panel(const Linear *a, long row, long n0, __m256 s0, __m256 s1,
                               __m256 s2, __m256 s3) {
    float sums[PANEL];
    _mm256_storeu_ps(sums, s0);
    _mm256_storeu_ps(sums + 8, s1);
    _mm256_storeu_ps(sums + 16, s2);
    _mm256_storeu_ps(sums + 24, s3);
    long cols = a->n - n0 < PANEL ? a->n - n0 : PANEL;
    if (a->bias)
        for (long c = 0; c < cols; c++) sums[c] += a->bias[n0 + c];
    memcpy(a->out + row * a->n + n0, sums, cols * sizeof(float));
}

#define FMA4(acc, xs, row)                                                                      \
    do {                                                                                           \
        __m256 xb = _mm256_broadcast_ss(xs + (row) * a->k + k);                                    \
        acc##0 = _mm256_fmadd_ps(xb, w0, acc##0);                                                  \
        acc##1 = _mm256_fmadd_ps(xb, w1, acc##1);                                                  \
        acc##2 = _mm256_fmadd_ps(xb, w2, acc##2);                                                  \
        acc##3 = _mm256_fmadd_ps(xb, w3, acc##3);                                                  \
    } while (0)

/* Rows [m0, m0 + ROWS) of panel p. ROWS is a constant in every call, and the accumulators are
 * named variables, not an array (an array of them was stored back to memory at every k). */
static inline __attribute__((always_inline)) void panel_rows(const Linear *a, long p, long m0,
                                                             const int ROWS) {
    __m256 r00, r01, r02, r03, r10, r11, r12, r13, r20, r21, r22, r23;
    r00 = r01 = r02 = r03 = r10 = r11 = r12 = r13 = r20 = r21 = r22 = r23 = _mm256_setzero_ps();
    const float *w = a->w + p * a->k * PANEL;
    const float *x = a->x + m0 * a->k;
    for (long k = 0; k < a->k; k++) {
        const float *wk = w + k * PANEL;
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
        FMA4(r0, x, 0);
        if (ROWS > 1) FMA4(r1, x, 1);
        if (ROWS > 2) FMA4(r2, x, 2);
    }
    long n0 = p * PANEL;
    store_panel(a, m0, n0, r00, r01, r02, r03);
    if (ROWS > 1) store_panel(a, m0 + 1, n0, r10, r11, r12, r13);
    if (ROWS > 2) store_panel(a, m0 + 2, n0, r20, r21, r22, r23);
}

void faser_linear_f32(const float *x, const float *w, const float *bias, float *out, long m,
                      long n, long k) {
    Linear a = {x, w, bias, out, m, n, k};
    long num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(dynamic, 1)
    for (long p = 0; p < num_panels; p++) {
        for (long m0 = 0; m0 < m; m0 += MAX_ROWS) {
            long rows = m - m0 < MAX_ROWS ? m - m0 : MAX_ROWS;
            if (rows == 1)
                panel_rows(&a, p, m0, 1);
            else if (rows == 2)
                panel_rows(&a, p, m0, 2);
            else
                panel_rows(&a, p, m0, 3);
        }
    }
}

int faser_linear_uses_amx(void) { return 0; }

#include "cpu_linear_blocks.c"
