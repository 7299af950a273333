/* Row-invariant float32 linear layers over weights held in GGUF's blocks, for x86 CPUs with AVX2
 * and FMA (AVX-512 CPUs have both): out[m, n] = x[m, :] . w[n, :] + b[n], included by
 * cpu_linear.c and cpu_linear_avx2.c.
 *
 * A checkpoint dequantized from a GGUF file holds, in every block of 32 weights along k, the
 * float32 values its quantization gives: d * q + m for q in 0..15 (Q4_1, one rounding of an exact
 * product), or d * q for q in -128..127 (Q8_0, exact). Such a weight is packed
 * (cpu_linear.pack_blocks) as, per panel of PANEL outputs and block of BLOCK k, the panel's d (and
 * m) in float32 and its q, 0.75 (1.125) bytes a weight against float32's 4; pack_blocks checks
 * that the dequantization below gives back every weight's bits. A thread dequantizes CHUNK blocks
 * of a panel into a buffer that stays in L1 and walks the float32 kernel's k loop over it: every
 * output is one accumulator walking k in order, as in the float32 kernels, so the bits are theirs
 * over the same float32 weights, and row m of an M-row call has those of a one-row call. The
 * accumulators wait in memory between chunks, which stores and reloads them exactly. A call of at
 * most REGISTER_ROWS rows has no other row group to share a chunk with, so it dequantizes each k
 * row into registers and multiplies it there instead: the same values in the same order, the same
 * bits, without a buffer's stores and loads. Each output's sum is a chain of dependent FMAs, and
 * the FMA units need about eight chains to cover their latency: one row walks two panels at once
 * (eight chains), two rows one panel, three to five rows half a panel at a time (the columns whose
 * Q4_1 nibbles share a k row's bytes), as a whole panel's accumulators for three rows, its four
 * vectors and its scales do not fit the sixteen registers. The AVX2 build's float32 kernel is the
 * same walk over the float32 panel itself (PANELS_F32). */
#include "cpu_prefetch.h"
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* cpu_linear.BLOCK_FORMATS; PANELS_F32: float32 panels [num_panels, K, PANEL], walked in place
 * (cpu_linear_avx2.c's float32 kernel) */
enum { PANELS_F32 = 0, BLOCKS_Q4_1 = 1, BLOCKS_Q8_0 = 2 };

#define BLOCK 32
#define SCALES (PANEL * (long)sizeof(float))
#define Q4_BYTES (2 * SCALES + BLOCK * PANEL / 2) /* d, m, then BLOCK rows of PANEL nibbles */
#define Q8_BYTES (SCALES + BLOCK * PANEL)         /* d, then BLOCK rows of PANEL bytes */
#define CHUNK 4                                   /* blocks per buffer: 16 KB of float32 */
#define ACC_ROWS 48                               /* rows a thread's accumulators hold */
#define GROUP 3                                   /* rows walked at once: 12 accumulators */
#define REGISTER_ROWS 5 /* calls of at most this many rows dequantize into registers */

#define TO_FLOAT(v) _mm256_cvtepi32_ps(v)

/* A block's d and m (Q4_1) for the columns c0 .. c0 + 7 (lo) and c0 + 16 .. c0 + 23 (hi), c0 0
 * or 8: the columns whose Q4_1 nibbles share a k row's bytes c0 .. c0 + 7. */
typedef struct {
    __m256 d_lo, d_hi, m_lo, m_hi;
} HalfScales;

static inline __attribute__((always_inline)) HalfScales half_scales(const uint8_t *block,
                                                                    int format, long c0) {
    const float *d = (const float *)block;
    HalfScales s = {_mm256_loadu_ps(d + c0), _mm256_loadu_ps(d + c0 + 16), _mm256_setzero_ps(),
                    _mm256_setzero_ps()};
    if (format == BLOCKS_Q4_1) {
        s.m_lo = _mm256_loadu_ps(d + PANEL + c0);
        s.m_hi = _mm256_loadu_ps(d + PANEL + c0 + 16);
    }
    return s;
}

/* Row kk of a block dequantized into lo and hi, the columns of half_scales' c0. Q4_1: byte j of a
 * k row holds column j's q in its low nibble and column j + 16's in its high one, so the row's
 * bytes c0 .. c0 + 7 widened to eight lanes give both vectors; w = fma(q, d, m). Q8_0: a k row's
 * PANEL signed bytes; w = d * q. */
static inline __attribute__((always_inline)) void dequantize_half(const uint8_t *block, long kk,
                                                                  int format, long c0,
                                                                  const HalfScales *s,
                                                                  __m256 *lo, __m256 *hi) {
    if (format == BLOCKS_Q4_1) {
        const uint8_t *qk = block + 2 * SCALES + kk * PANEL / 2 + c0;
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qk));
        *lo = _mm256_fmadd_ps(TO_FLOAT(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))), s->d_lo,
                              s->m_lo);
        *hi = _mm256_fmadd_ps(TO_FLOAT(_mm256_srli_epi32(q, 4)), s->d_hi, s->m_hi);
    } else {
        const int8_t *qk = (const int8_t *)(block + SCALES) + kk * PANEL + c0;
        *lo = _mm256_mul_ps(TO_FLOAT(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qk))),
                            s->d_lo);
        *hi = _mm256_mul_ps(
            TO_FLOAT(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 16)))),
            s->d_hi);
    }
}

/* Row kk of a block dequantized into w[0..3], columns 8 c .. 8 c + 7 in w[c]. */
static inline __attribute__((always_inline)) void dequantize_row(const uint8_t *block, long kk,
                                                                 int format, __m256 w[4]) {
    HalfScales first = half_scales(block, format, 0), second = half_scales(block, format, 8);
    dequantize_half(block, kk, format, 0, &first, &w[0], &w[2]);
    dequantize_half(block, kk, format, 8, &second, &w[1], &w[3]);
}

/* A block dequantized into buf [BLOCK, PANEL], row by row. */
static inline void dequantize_block(const uint8_t *block, int format, float *buf) {
    for (long kk = 0; kk < BLOCK; kk++) {
        __m256 w[4];
        dequantize_row(block, kk, format, w);
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(buf + kk * PANEL + 8 * c, w[c]);
    }
}

#define BLOCK_FMA(r, i)                                                                            \
    if (ROWS > i) {                                                                                \
        __m256 xb = _mm256_broadcast_ss(x + (i) * ldx + k);                                        \
        r##0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk), r##0);                                     \
        r##1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8), r##1);                                 \
        r##2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 16), r##2);                                \
        r##3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 24), r##3);                                \
    }
#define BLOCK_LOAD(r, i)                                                                           \
    if (ROWS > i) {                                                                                \
        r##0 = _mm256_loadu_ps(acc + (i) * PANEL);                                                 \
        r##1 = _mm256_loadu_ps(acc + (i) * PANEL + 8);                                             \
        r##2 = _mm256_loadu_ps(acc + (i) * PANEL + 16);                                            \
        r##3 = _mm256_loadu_ps(acc + (i) * PANEL + 24);                                            \
    }
#define BLOCK_STORE(r, i)                                                                          \
    if (ROWS > i) {                                                                                \
        _mm256_storeu_ps(acc + (i) * PANEL, r##0);                                                 \
        _mm256_storeu_ps(acc + (i) * PANEL + 8, r##1);                                             \
        _mm256_storeu_ps(acc + (i) * PANEL + 16, r##2);                                            \
        _mm256_storeu_ps(acc + (i) * PANEL + 24, r##3);                                            \
    }

/* ROWS rows (x, ldx apart, at the chunk's first k) over the chunk's kc k of buf, their
 * accumulators acc [ROWS, PANEL] in and out. */
static inline __attribute__((always_inline)) void block_rows(const float *x, long ldx,
                                                             const float *buf, long kc,
                                                             float *acc, const int ROWS) {
    __m256 a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3;
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = _mm256_setzero_ps();
    BLOCK_LOAD(a, 0) BLOCK_LOAD(b, 1) BLOCK_LOAD(c, 2)
    for (long k = 0; k < kc; k++) {
        const float *wk = buf + k * PANEL;
        BLOCK_FMA(a, 0) BLOCK_FMA(b, 1) BLOCK_FMA(c, 2)
    }
    BLOCK_STORE(a, 0) BLOCK_STORE(b, 1) BLOCK_STORE(c, 2)
}

typedef struct {
    const float *x;
    const uint8_t *w;
    const float *bias;
    float *out;
    long m, n, k, block_bytes;
    int format;
} Blocks;

/* Rows [m0, m0 + rows) over kc k from k0, of w [kc, PANEL]: GROUP rows at a time. */
static void walk(const Blocks *a, long m0, long rows, const float *w, long k0, long kc,
                 float *acc) {
    for (long r = 0; r < rows; r += GROUP) {
        const float *xr = a->x + (m0 + r) * a->k + k0;
        long g = rows - r < GROUP ? rows - r : GROUP;
        if (g == 1)
            block_rows(xr, a->k, w, kc, acc + r * PANEL, 1);
        else if (g == 2)
            block_rows(xr, a->k, w, kc, acc + r * PANEL, 2);
        else
            block_rows(xr, a->k, w, kc, acc + r * PANEL, 3);
    }
}

#define ROW_FMA(r, xb)                                                                             \
    r##0 = _mm256_fmadd_ps(xb, w[0], r##0);                                                        \
    r##1 = _mm256_fmadd_ps(xb, w[1], r##1);                                                        \
    r##2 = _mm256_fmadd_ps(xb, w[2], r##2);                                                        \
    r##3 = _mm256_fmadd_ps(xb, w[3], r##3);
#define STORE4(r, at)                                                                              \
    _mm256_storeu_ps((at), r##0);                                                                  \
    _mm256_storeu_ps((at) + 8, r##1);                                                              \
    _mm256_storeu_ps((at) + 16, r##2);                                                             \
    _mm256_storeu_ps((at) + 24, r##3);

/* Rows [0, ROWS) of panels [p, p + PANELS) over all of k, ROWS * PANELS <= 2, each k row of the
 * blocks dequantized into registers; their sums to acc, [ROWS, PANEL] or [PANELS, PANEL]. */
static inline __attribute__((always_inline)) void register_rows(const Blocks *a, long p,
                                                                float *acc, const int ROWS,
                                                                const int PANELS) {
    long num_blocks = a->k / BLOCK, panel_bytes = num_blocks * a->block_bytes;
    const uint8_t *panel = a->w + p * panel_bytes;
    __m256 a0, a1, a2, a3, b0, b1, b2, b3, w[4];
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _mm256_setzero_ps();
    for (long blk = 0; blk < num_blocks; blk++) {
        const uint8_t *block = panel + blk * a->block_bytes;
        prefetch_ahead(block, a->block_bytes);
        if (PANELS == 2) prefetch_ahead(block + panel_bytes, a->block_bytes);
        for (long kk = 0; kk < BLOCK; kk++) {
            long k = blk * BLOCK + kk;
            __m256 x0 = _mm256_broadcast_ss(a->x + k);
            dequantize_row(block, kk, a->format, w);
            ROW_FMA(a, x0)
            if (ROWS == 2) {
                __m256 x1 = _mm256_broadcast_ss(a->x + a->k + k);
                ROW_FMA(b, x1)
            } else if (PANELS == 2) {
                dequantize_row(block + panel_bytes, kk, a->format, w);
                ROW_FMA(b, x0)
            }
        }
    }
    STORE4(a, acc)
    if (ROWS * PANELS == 2) {
        STORE4(b, acc + PANEL)
    }
}

#define HALF_FMA(r, i)                                                                             \
    if (ROWS > i) {                                                                                \
        __m256 xb = _mm256_broadcast_ss(a->x + (i) * a->k + k);                                    \
        r##0 = _mm256_fmadd_ps(xb, lo, r##0);                                                      \
        r##1 = _mm256_fmadd_ps(xb, hi, r##1);                                                      \
    }
#define HALF_STORE(r, i)                                                                           \
    if (ROWS > i) {                                                                                \
        _mm256_storeu_ps(acc + (i) * PANEL + col, r##0);                                           \
        _mm256_storeu_ps(acc + (i) * PANEL + col + 16, r##1);                                      \
    }

/* Rows [0, ROWS) of panel p, ROWS <= 5, over the columns of dequantize_half's c0 = col, each k
 * row of the blocks dequantized into registers; their sums to acc [ROWS, PANEL]. */
static inline __attribute__((always_inline)) void register_half(const Blocks *a, long p, long col,
                                                                float *acc, const int ROWS) {
    long num_blocks = a->k / BLOCK;
    const uint8_t *panel = a->w + p * num_blocks * a->block_bytes;
    __m256 a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, lo, hi;
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = e0 = e1 = _mm256_setzero_ps();
    for (long blk = 0; blk < num_blocks; blk++) {
        const uint8_t *block = panel + blk * a->block_bytes;
        prefetch_ahead(block, a->block_bytes);
        HalfScales scales = half_scales(block, a->format, col);
        for (long kk = 0; kk < BLOCK; kk++) {
            long k = blk * BLOCK + kk;
            dequantize_half(block, kk, a->format, col, &scales, &lo, &hi);
            HALF_FMA(a, 0) HALF_FMA(b, 1) HALF_FMA(c, 2) HALF_FMA(d, 3) HALF_FMA(e, 4)
        }
    }
    HALF_STORE(a, 0) HALF_STORE(b, 1) HALF_STORE(c, 2) HALF_STORE(d, 3) HALF_STORE(e, 4)
}

/* Rows [m0, m0 + rows) of panel p from their sums acc [rows, PANEL], the bias added. */
static void store_sums(const Blocks *a, long m0, long rows, long p, float *acc) {
    long n0 = p * PANEL, cols = a->n - n0 < PANEL ? a->n - n0 : PANEL;
    for (long r = 0; r < rows; r++) {
        float *sums = acc + r * PANEL;
        if (a->bias)
            for (long c = 0; c < cols; c++) sums[c] += a->bias[n0 + c];
        memcpy(a->out + (m0 + r) * a->n + n0, sums, cols * sizeof(float));
    }
}

/* Panels [p, p + panels) of a call of at most REGISTER_ROWS rows: two panels at a time for one
 * row, else one. */
static void register_panels(const Blocks *a, long p, long panels, float *acc) {
    if (a->m == 1) {
        if (panels == 2)
            register_rows(a, p, acc, 1, 2);
        else
            register_rows(a, p, acc, 1, 1);
        for (long i = 0; i < panels; i++)
            store_sums(a, 0, 1, p + i, acc + i * PANEL);
        return;
    }
    if (a->m == 2) {
        register_rows(a, p, acc, 2, 1);
    } else {
        for (long col = 0; col < 16; col += 8) {
            switch (a->m) {
            case 3: register_half(a, p, col, acc, 3); break;
            case 4: register_half(a, p, col, acc, 4); break;
            default: register_half(a, p, col, acc, 5); break;
            }
        }
    }
    store_sums(a, 0, a->m, p, acc);
}

/* Rows [m0, m0 + rows) of panel p, rows <= ACC_ROWS, through a buffer (or in place). */
static void blocks_panel(const Blocks *a, long m0, long rows, long p, float *buf, float *acc) {
    memset(acc, 0, rows * PANEL * sizeof(float));
    if (a->format == PANELS_F32) {
        walk(a, m0, rows, (const float *)a->w + p * a->k * PANEL, 0, a->k, acc);
    } else {
        long num_blocks = a->k / BLOCK;
        const uint8_t *panel = a->w + p * num_blocks * a->block_bytes;
        for (long b0 = 0; b0 < num_blocks; b0 += CHUNK) {
            long nb = num_blocks - b0 < CHUNK ? num_blocks - b0 : CHUNK;
            for (long b = 0; b < nb; b++) {
                prefetch_ahead(panel + (b0 + b) * a->block_bytes, a->block_bytes);
                dequantize_block(panel + (b0 + b) * a->block_bytes, a->format,
                                 buf + b * BLOCK * PANEL);
            }
            walk(a, m0, rows, buf, b0 * BLOCK, nb * BLOCK, acc);
        }
    }
    store_sums(a, m0, rows, p, acc);
}

/* x [m, k], w packed by pack_blocks in `format` (k a multiple of BLOCK) or, PANELS_F32, by
 * pack_weight in float32, bias [n] or NULL, out [m, n]. */
void faser_linear_blocks(const float *x, const uint8_t *w, const float *bias, float *out, long m,
                         long n, long k, int format) {
    Blocks a = {x, w, bias, out, m, n, k, format == BLOCKS_Q4_1 ? Q4_BYTES : Q8_BYTES, format};
    long num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel
    {
        float buf[CHUNK * BLOCK * PANEL] __attribute__((aligned(64)));
        float acc[ACC_ROWS * PANEL] __attribute__((aligned(64)));
        if (format != PANELS_F32 && m <= REGISTER_ROWS) {
            long step = m == 1 ? 2 : 1; /* panels at once */
#pragma omp for schedule(dynamic, 1)
            for (long p = 0; p < num_panels; p += step)
                register_panels(&a, p, num_panels - p < step ? num_panels - p : step, acc);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (long p = 0; p < num_panels; p++)
                for (long m0 = 0; m0 < m; m0 += ACC_ROWS)
                    blocks_panel(&a, m0, m - m0 < ACC_ROWS ? m - m0 : ACC_ROWS, p, buf, acc);
        }
    }
}
