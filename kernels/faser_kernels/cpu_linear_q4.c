/* Row-invariant float32 linear layers over weights held in 4-bit blocks, for x86 CPUs with AVX2
 * and FMA (AVX-512 CPUs have both): out[m, n] = x[m, :] . w[n, :] + b[n], included by
 * cpu_linear.c and cpu_linear_avx2.c.
 *
 * A checkpoint dequantized from GGUF's Q4_1 holds, in every block of 32 weights along k, the
 * float32 values d * q + m for q in 0..15: one rounding of an exact product. Such a weight is
 * packed (cpu_linear.pack_q4) as, per panel of PANEL outputs and block of Q4_BLOCK k, the panel's
 * d and m (float32) and its 4-bit q, a sixth of the float32 panel's bytes; pack_q4 checks that
 * fma(q, d, m) gives back every weight's bits. A thread dequantizes Q4_CHUNK blocks of a panel
 * into a buffer that stays in L1 and walks the float32 kernel's k loop over it: every output is
 * one accumulator walking k in order, as in the float32 kernels, so the bits are theirs (over the
 * same float32 weights) and row m of an M-row call has those of a one-row call. The accumulators
 * wait in memory between chunks, which stores and reloads them exactly. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define Q4_BLOCK 32
#define Q4_HEAD (2 * PANEL * (long)sizeof(float))   /* d[PANEL], m[PANEL] */
#define Q4_BYTES (Q4_HEAD + Q4_BLOCK * PANEL / 2)   /* then Q4_BLOCK rows of PANEL nibbles */
#define Q4_CHUNK 4                                  /* blocks per buffer: 16 KB of float32 */
#define Q4_ROWS 48                                  /* rows a thread's accumulators hold */
#define Q4_GROUP 3                                  /* rows walked at once: 12 accumulators */

/* One block into buf [Q4_BLOCK, PANEL]: byte j of a k row holds column j's q in its low nibble
 * and column j + 16's in its high one. */
static inline void q4_dequantize(const uint8_t *block, float *buf) {
    const float *d = (const float *)block, *m = d + PANEL;
    const uint8_t *q = block + Q4_HEAD;
    __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    __m256 d2 = _mm256_loadu_ps(d + 16), d3 = _mm256_loadu_ps(d + 24);
    __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8);
    __m256 m2 = _mm256_loadu_ps(m + 16), m3 = _mm256_loadu_ps(m + 24);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (long k = 0; k < Q4_BLOCK; k++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + k * PANEL / 2));
        __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
#define Q4_COLUMNS(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
        float *row = buf + k * PANEL;
        _mm256_storeu_ps(row, _mm256_fmadd_ps(Q4_COLUMNS(lo), d0, m0));
        _mm256_storeu_ps(row + 8, _mm256_fmadd_ps(Q4_COLUMNS(_mm_srli_si128(lo, 8)), d1, m1));
        _mm256_storeu_ps(row + 16, _mm256_fmadd_ps(Q4_COLUMNS(hi), d2, m2));
        _mm256_storeu_ps(row + 24, _mm256_fmadd_ps(Q4_COLUMNS(_mm_srli_si128(hi, 8)), d3, m3));
#undef Q4_COLUMNS
    }
}

#define Q4_FMA(r, i)                                                                               \
    if (ROWS > i) {                                                                                \
        __m256 xb = _mm256_broadcast_ss(x + (i) * ldx + k);                                        \
        r##0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk), r##0);                                     \
        r##1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8), r##1);                                 \
        r##2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 16), r##2);                                \
        r##3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 24), r##3);                                \
    }
#define Q4_LOAD(r, i)                                                                              \
    if (ROWS > i) {                                                                                \
        r##0 = _mm256_loadu_ps(acc + (i) * PANEL);                                                 \
        r##1 = _mm256_loadu_ps(acc + (i) * PANEL + 8);                                             \
        r##2 = _mm256_loadu_ps(acc + (i) * PANEL + 16);                                            \
        r##3 = _mm256_loadu_ps(acc + (i) * PANEL + 24);                                            \
    }
#define Q4_STORE(r, i)                                                                             \
    if (ROWS > i) {                                                                                \
        _mm256_storeu_ps(acc + (i) * PANEL, r##0);                                                 \
        _mm256_storeu_ps(acc + (i) * PANEL + 8, r##1);                                             \
        _mm256_storeu_ps(acc + (i) * PANEL + 16, r##2);                                            \
        _mm256_storeu_ps(acc + (i) * PANEL + 24, r##3);                                            \
    }

/* ROWS rows (x, ldx apart, at the chunk's first k) over the chunk's kc k of buf, their
 * accumulators acc [ROWS, PANEL] in and out. */
static inline __attribute__((always_inline)) void q4_rows(const float *x, long ldx,
                                                          const float *buf, long kc, float *acc,
                                                          const int ROWS) {
    __m256 a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3;
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = _mm256_setzero_ps();
    Q4_LOAD(a, 0) Q4_LOAD(b, 1) Q4_LOAD(c, 2)
    for (long k = 0; k < kc; k++) {
        const float *wk = buf + k * PANEL;
        Q4_FMA(a, 0) Q4_FMA(b, 1) Q4_FMA(c, 2)
    }
    Q4_STORE(a, 0) Q4_STORE(b, 1) Q4_STORE(c, 2)
}

/* Rows [m0, m0 + rows) of panel p, rows <= Q4_ROWS. */
static void q4_panel(const float *x, const uint8_t *w, const float *bias, float *out, long m0,
                     long rows, long p, long n, long k, float *buf, float *acc) {
    long num_blocks = k / Q4_BLOCK;
    const uint8_t *panel = w + p * num_blocks * Q4_BYTES;
    memset(acc, 0, rows * PANEL * sizeof(float));
    for (long b0 = 0; b0 < num_blocks; b0 += Q4_CHUNK) {
        long nb = num_blocks - b0 < Q4_CHUNK ? num_blocks - b0 : Q4_CHUNK;
        for (long b = 0; b < nb; b++)
            q4_dequantize(panel + (b0 + b) * Q4_BYTES, buf + b * Q4_BLOCK * PANEL);
        long kc = nb * Q4_BLOCK;
        for (long r = 0; r < rows; r += Q4_GROUP) {
            const float *xr = x + (m0 + r) * k + b0 * Q4_BLOCK;
            long g = rows - r < Q4_GROUP ? rows - r : Q4_GROUP;
            if (g == 1)
                q4_rows(xr, k, buf, kc, acc + r * PANEL, 1);
            else if (g == 2)
                q4_rows(xr, k, buf, kc, acc + r * PANEL, 2);
            else
                q4_rows(xr, k, buf, kc, acc + r * PANEL, 3);
        }
    }
    long n0 = p * PANEL, cols = n - n0 < PANEL ? n - n0 : PANEL;
    for (long r = 0; r < rows; r++) {
        float *sums = acc + r * PANEL;
        if (bias)
            for (long c = 0; c < cols; c++) sums[c] += bias[n0 + c];
        memcpy(out + (m0 + r) * n + n0, sums, cols * sizeof(float));
    }
}

/* x [m, k], w packed by pack_q4 (k a multiple of Q4_BLOCK), bias [n] or NULL, out [m, n]. */
void faser_linear_q4(const float *x, const uint8_t *w, const float *bias, float *out, long m,
                     long n, long k) {
    long num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel
    {
        float buf[Q4_CHUNK * Q4_BLOCK * PANEL] __attribute__((aligned(64)));
        float acc[Q4_ROWS * PANEL] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (long p = 0; p < num_panels; p++)
            for (long m0 = 0; m0 < m; m0 += Q4_ROWS)
                q4_panel(x, w, bias, out, m0, m - m0 < Q4_ROWS ? m - m0 : Q4_ROWS, p, n, k, buf,
                         acc);
    }
}
