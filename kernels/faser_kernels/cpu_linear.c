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
 *   GGUF's blocks of a weight that a bf16 model holds rounded (cpu_linear_blocks.c's layout):
 *   dequantized into bf16 panels as a call goes, or into registers for a call of a few rows
 *   (below)
 * Each panel is multiplied with up to MAX_ROWS rows at a time, all held in registers. An int8
 * weight is widened to bf16 in registers (every int8 is exact in bf16) and its scale applied
 * once per output, after the sum, so the sum walks k as the bf16 kernel's does.
 *
 * Where the CPU has AMX (and K is a multiple of 32), a bf16 weight is multiplied on the tiles
 * instead: there (Intel's Xeons) the vector dot products are slow enough that each row beyond
 * the first costs the step compute, while a tile product takes 16 rows for the price of one.
 * The tiles read the same panels (a panel's k-pair rows are two B tiles side by side). Every
 * call on such a CPU takes the tiles, always with 16-row tiles (the rows past M are zeros), so
 * an output's bits still depend only on its own row: which of the two tile kernels takes it, and
 * in which block of rows, changes only the order in which outputs are made, never how one sums.
 */
#include "cpu_amx.h"
#include "cpu_prefetch.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define PANEL 32
#define MAX_ROWS 12

#include "cpu_linear_blocks.c"

typedef struct {
    const void *x;      /* [M, K] bf16 or fp32, rows contiguous */
    const void *w;      /* packed, see above */
    const float *scale; /* [N] for an int8 weight, else NULL */
    const float *bias;  /* [N] or NULL */
    void *out;          /* [M, N] bf16 or fp32 */
    long m, n, k;
    int blocks; /* a bf16 weight held in GGUF's blocks: cpu_linear_blocks.c's code; else 0 */
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

/* Rows [m0, m0 + ROWS) of panel p (its data at w) of a bf16 (INT8 0) or int8 (INT8 1) weight,
 * both taken as bf16 k-pairs; ROWS and INT8 are constants in every call, so acc lives in
 * registers. */
static inline __attribute__((always_inline)) void panel_pairs(const Linear *a, const char *w,
                                                              long p, long m0, const int ROWS,
                                                              const int INT8) {
    __m512 acc[MAX_ROWS][2];
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint16_t *x = (const uint16_t *)a->x + m0 * a->k;
    for (long kp = 0; kp < a->k / 2; kp++) {
        __m512bh w0, w1;
        prefetch_ahead(w + kp * 2 * PANEL * (INT8 ? 1 : 2), INT8 ? 64 : 128);
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

static inline __attribute__((always_inline)) void panel_bf16(const Linear *a, const char *w,
                                                             long p, long m0, const int ROWS) {
    panel_pairs(a, w, p, m0, ROWS, 0);
}

static inline __attribute__((always_inline)) void panel_i8(const Linear *a, const char *w, long p,
                                                           long m0, const int ROWS) {
    panel_pairs(a, w, p, m0, ROWS, 1);
}

static inline __attribute__((always_inline)) void panel_f32(const Linear *a, const char *panel,
                                                            long p, long m0, const int ROWS) {
    __m512 acc[MAX_ROWS][2];
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const float *w = (const float *)panel;
    const float *x = (const float *)a->x + m0 * a->k;
    for (long k = 0; k < a->k; k++) {
        prefetch_ahead(w + k * PANEL, 128);
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

#define DISPATCH(fn, a, w, p, m0, rows)                                                            \
    switch (rows) {                                                                                \
    case 1: fn(a, w, p, m0, 1); break;                                                             \
    case 2: fn(a, w, p, m0, 2); break;                                                             \
    case 3: fn(a, w, p, m0, 3); break;                                                             \
    case 4: fn(a, w, p, m0, 4); break;                                                             \
    case 5: fn(a, w, p, m0, 5); break;                                                             \
    case 6: fn(a, w, p, m0, 6); break;                                                             \
    case 7: fn(a, w, p, m0, 7); break;                                                             \
    case 8: fn(a, w, p, m0, 8); break;                                                             \
    case 9: fn(a, w, p, m0, 9); break;                                                             \
    case 10: fn(a, w, p, m0, 10); break;                                                           \
    case 11: fn(a, w, p, m0, 11); break;                                                           \
    default: fn(a, w, p, m0, 12); break;                                                           \
    }

/* -- bf16 over GGUF's blocks ---------------------------------------------------------------------
 * A float32 checkpoint dequantized from a GGUF file, loaded in bf16, holds each weight rounded to
 * bf16. Its blocks (cpu_linear.pack_blocks) take 0.75 or 1.125 bytes a weight against bf16's 2;
 * a call dequantizes each of its panels into a bf16 panel (pack_weight's layout) and multiplies
 * that as it would the packed bf16 weight: the same weights in the same order, the same bits. A
 * call of at most REGISTER_ROWS rows (a decode at low load, a short verification) dequantizes each
 * k pair into registers and multiplies it there instead, streaming 0.375-0.56x the bf16 panels'
 * bytes and storing none; the dequantization costs about as much as the stream, so each row
 * past the first adds its products to a call that is already near its compute. Past that, a
 * panel dequantized once serves all of the call's rows. */

/* Row kk of a block, all PANEL columns, as float32: the values cpu_linear_blocks.c's
 * dequantize_row gives (the same fma or product per column), sixteen columns a vector. */
static inline __attribute__((always_inline)) void dequantize_row16(const uint8_t *block, long kk,
                                                                   int format, const __m512 *d,
                                                                   const __m512 *m, __m512 *lo,
                                                                   __m512 *hi) {
    if (format == BLOCKS_Q4_1) { /* byte j: column j's q in its low nibble, j + 16's high */
        __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(block + 2 * SCALES + kk * PANEL / 2)));
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F))),
                              d[0], m[0]);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d[1], m[1]);
    } else {
        const int8_t *q = (const int8_t *)(block + SCALES) + kk * PANEL;
        *lo = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), d[0]);
        *hi = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
            d[1]);
    }
}

/* A block's d (and m, Q4_1: else d again) for the panel's two halves of sixteen columns. */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *block, int format,
                                                               __m512 d[2], __m512 m[2]) {
    const float *scales = (const float *)block;
    d[0] = m[0] = _mm512_loadu_ps(scales);
    d[1] = m[1] = _mm512_loadu_ps(scales + 16);
    if (format == BLOCKS_Q4_1) {
        m[0] = _mm512_loadu_ps(scales + PANEL);
        m[1] = _mm512_loadu_ps(scales + PANEL + 16);
    }
}

/* Rows kk and kk + 1 of a block (kk even) as the bf16 panel's k-pair row: columns 0-15 in w0,
 * 16-31 in w1. Each weight is dequantized to float32 as the float32 kernel does, then rounded to
 * nearest even, as torch rounds the float32 checkpoint (a block's weights are zeros or far above
 * float32's denormals, which the conversion flushes). */
static inline __attribute__((always_inline)) void dequantize_pair(const uint8_t *block, long kk,
                                                                  int format, const __m512 d[2],
                                                                  const __m512 m[2], __m512bh *w0,
                                                                  __m512bh *w1) {
    /* a column's two k as a pair: even k in the low half of each 32-bit lane */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    __m512 even_lo, even_hi, odd_lo, odd_hi;
    dequantize_row16(block, kk, format, d, m, &even_lo, &even_hi);
    dequantize_row16(block, kk + 1, format, d, m, &odd_lo, &odd_hi);
    *w0 = (__m512bh)_mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(odd_lo, even_lo));
    *w1 = (__m512bh)_mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(odd_hi, even_hi));
}

static inline long blocks_bytes(const Linear *a) {
    return a->blocks == BLOCKS_Q4_1 ? Q4_BYTES : Q8_BYTES;
}

/* Block blk of panel p of a.w's blocks as the bf16 panel's BLOCK / 2 k-pair rows at out. */
static inline __attribute__((always_inline)) void dequantize_bf16_block(const Linear *a, long p,
                                                                        long blk,
                                                                        uint16_t *out) {
    long block_bytes = blocks_bytes(a);
    const uint8_t *block = (const uint8_t *)a->w + (p * (a->k / BLOCK) + blk) * block_bytes;
    prefetch_ahead(block, block_bytes);
    __m512 d[2], m[2];
    block_scales(block, a->blocks, d, m);
    for (long kk = 0; kk < BLOCK; kk += 2) {
        __m512bh w0, w1;
        dequantize_pair(block, kk, a->blocks, d, m, &w0, &w1);
        _mm512_storeu_si512(out + kk * PANEL, (__m512i)w0); /* k pair kk / 2 */
        _mm512_storeu_si512(out + kk * PANEL + 2 * 16, (__m512i)w1);
    }
}

/* Rows [0, ROWS) of panel p of a bf16 call over GGUF's blocks, ROWS <= REGISTER_ROWS: each k pair
 * dequantized into registers and multiplied there, as panel_bf16 multiplies the bf16 panel's (the
 * same values in the same order, the same bits) without writing and reading back a panel. */
static inline __attribute__((always_inline)) void panel_blocks(const Linear *a, long p,
                                                               const int ROWS) {
    __m512 acc[REGISTER_ROWS][2];
    for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    long block_bytes = blocks_bytes(a), num_blocks = a->k / BLOCK;
    const uint8_t *panel = (const uint8_t *)a->w + p * num_blocks * block_bytes;
    const uint16_t *x = (const uint16_t *)a->x;
    for (long blk = 0; blk < num_blocks; blk++) {
        const uint8_t *block = panel + blk * block_bytes;
        prefetch_ahead(block, block_bytes);
        __m512 d[2], m[2];
        block_scales(block, a->blocks, d, m);
        for (long kk = 0; kk < BLOCK; kk += 2) {
            __m512bh w0, w1;
            dequantize_pair(block, kk, a->blocks, d, m, &w0, &w1);
            for (int i = 0; i < ROWS; i++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32(
                    *(const int32_t *)(x + i * a->k + blk * BLOCK + kk));
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
            }
        }
    }
    for (int i = 0; i < ROWS; i++) store_panel(a, i, p * PANEL, acc[i][0], acc[i][1], 1);
}

/* One row over panels p and p + 1 at once: four chains of dependent dot products, not two, hide
 * their latency. */
static void panel_blocks_pair(const Linear *a, long p) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    long block_bytes = blocks_bytes(a), num_blocks = a->k / BLOCK;
    long panel_bytes = num_blocks * block_bytes;
    const uint8_t *panel = (const uint8_t *)a->w + p * panel_bytes;
    const uint16_t *x = (const uint16_t *)a->x;
    for (long blk = 0; blk < num_blocks; blk++) {
        const uint8_t *first = panel + blk * block_bytes, *second = first + panel_bytes;
        prefetch_ahead(first, block_bytes);
        prefetch_ahead(second, block_bytes);
        __m512 d[2], m[2], d2[2], m2[2];
        block_scales(first, a->blocks, d, m);
        block_scales(second, a->blocks, d2, m2);
        for (long kk = 0; kk < BLOCK; kk += 2) {
            __m512bh w0, w1, w2, w3;
            dequantize_pair(first, kk, a->blocks, d, m, &w0, &w1);
            dequantize_pair(second, kk, a->blocks, d2, m2, &w2, &w3);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + blk * BLOCK + kk));
            acc0 = _mm512_dpbf16_ps(acc0, xb, w0);
            acc1 = _mm512_dpbf16_ps(acc1, xb, w1);
            acc2 = _mm512_dpbf16_ps(acc2, xb, w2);
            acc3 = _mm512_dpbf16_ps(acc3, xb, w3);
        }
    }
    store_panel(a, 0, p * PANEL, acc0, acc1, 1);
    store_panel(a, 0, (p + 1) * PANEL, acc2, acc3, 1);
}

/* A bf16 call of at most REGISTER_ROWS rows over GGUF's blocks: one or two panels an item. */
static void run_blocks_in_registers(const Linear *a, long num_panels) {
    long step = a->m == 1 ? 2 : 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (long p = 0; p < num_panels; p += step) {
        switch (a->m) {
        case 1:
            if (p + 1 < num_panels)
                panel_blocks_pair(a, p);
            else
                panel_blocks(a, p, 1);
            break;
        case 2: panel_blocks(a, p, 2); break;
        case 3: panel_blocks(a, p, 3); break;
        case 4: panel_blocks(a, p, 4); break;
        default: panel_blocks(a, p, 5); break;
        }
    }
}

/* The data of panels [p, end) of a bf16 weight: in place, or its blocks dequantized into bf16
 * panels ([K / 2, PANEL, 2] each) in a new buffer, which the caller frees. */
static const char *dequantized_panels(const Linear *a, long p, long end) {
    if (!a->blocks) return (const char *)a->w + p * a->k * PANEL * 2;
    uint16_t *buf = aligned_alloc(64, (end - p) * a->k * PANEL * 2);
    if (!buf) abort();
    for (long i = p; i < end; i++)
        for (long blk = 0; blk < a->k / BLOCK; blk++)
            dequantize_bf16_block(a, i, blk, buf + ((i - p) * a->k + blk * BLOCK) * PANEL);
    return (const char *)buf;
}

/* -- AMX: bf16 weights on the tiles ------------------------------------------------------------ */

int faser_linear_uses_amx(void) { return amx_enabled(); }

/* Two kernels, each with four accumulators in tmm0-3 (configure_tiles, cpu_amx.h): one row tile
 * against two panels (a decode's or a verification's rows), and, for more rows, two row tiles
 * against one panel, which loads a tile per product where the first loads 1.25. */

/* The accumulators' sums to out: tile 2q + h holds rows m0 + 16 (q if `rows_by_q`) .. of panel
 * p + q (else p), outputs h * 16 .. h * 16 + 15. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_store(const Linear *a, long p,
                                                                   long m0, int num,
                                                                   int rows_by_q) {
    float c[4][TILE_ROWS][16] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (num > 1) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
    for (int q = 0; q < num; q++) {
        long row = rows_by_q ? m0 + q * TILE_ROWS : m0, panel = rows_by_q ? p : p + q;
        long rows = a->m - row < TILE_ROWS ? a->m - row : TILE_ROWS;
        for (long i = 0; i < rows; i++)
            store_panel(a, row + i, panel * PANEL, _mm512_load_ps(c[2 * q][i]),
                        _mm512_load_ps(c[2 * q + 1][i]), 1);
    }
}

/* tmm0-3, the accumulators, to zero. */
__attribute__((target("amx-tile"))) static inline void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Panels p and p + 1 (if `two`) for the 16 rows at x (row stride K), to out rows m0.. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_panels(const Linear *a,
                                                                    const uint16_t *x, long p,
                                                                    int two, long m0) {
    const long stride = a->k * 2, panel = a->k * PANEL * 2; /* bytes */
    const char *w = (const char *)a->w + p * panel;
    zero_accumulators();
    for (long k0 = 0; k0 < a->k; k0 += TILE_K) {
        const char *b = w + k0 / 2 * PANEL * 4; /* 16 k-pair rows of 128 bytes */
        _tile_loadd(4, x + k0, stride);
        _tile_loadd(5, b, 4 * PANEL);
        _tile_loadd(6, b + 2 * PANEL, 4 * PANEL);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if (two) {
            _tile_loadd(7, b + panel, 4 * PANEL);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + panel + 2 * PANEL, 4 * PANEL);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    amx_store(a, p, m0, two ? 2 : 1, 0);
}

/* As amx_panels for a weight in blocks and at most 16 rows: each block of the two panels
 * dequantized into L1 just before its products. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_block_panels(const Linear *a,
                                                                          const uint16_t *x,
                                                                          long p, int two) {
    uint16_t b[2][BLOCK * PANEL] __attribute__((aligned(64))); /* a block of each panel */
    const long stride = a->k * 2;
    zero_accumulators();
    for (long k0 = 0; k0 < a->k; k0 += TILE_K) {
        dequantize_bf16_block(a, p, k0 / BLOCK, b[0]);
        _tile_loadd(4, x + k0, stride);
        _tile_loadd(5, b[0], 4 * PANEL);
        _tile_loadd(6, b[0] + PANEL, 4 * PANEL);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if (two) {
            dequantize_bf16_block(a, p + 1, k0 / BLOCK, b[1]);
            _tile_loadd(7, b[1], 4 * PANEL);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b[1] + PANEL, 4 * PANEL);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    amx_store(a, p, 0, two ? 2 : 1, 0);
}

/* As amx_rows for a weight in blocks: panel p for the 16 rows at x0 and, unless x1 is NULL, the
 * 16 at x1 (rows m0 + 16..), each block dequantized into L1 just before its products. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_block_rows(const Linear *a,
                                                                        const uint16_t *x0,
                                                                        const uint16_t *x1,
                                                                        long p, long m0) {
    uint16_t b[BLOCK * PANEL] __attribute__((aligned(64))); /* a block of the panel */
    const long stride = a->k * 2;
    zero_accumulators();
    for (long k0 = 0; k0 < a->k; k0 += TILE_K) {
        dequantize_bf16_block(a, p, k0 / BLOCK, b);
        _tile_loadd(6, b, 4 * PANEL);
        _tile_loadd(7, b + PANEL, 4 * PANEL);
        _tile_loadd(4, x0 + k0, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (x1) {
            _tile_loadd(5, x1 + k0, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    amx_store(a, p, m0, x1 ? 2 : 1, 1);
}

/* Panel p (its data at w) for the 32 rows at x (row stride K), to out rows m0..: tmm4-5 the two
 * row tiles, tmm6-7 the panel's halves. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_rows(const Linear *a,
                                                                  const uint16_t *x,
                                                                  const char *w, long p,
                                                                  long m0) {
    const long stride = a->k * 2;
    zero_accumulators();
    for (long k0 = 0; k0 < a->k; k0 += TILE_K) {
        const char *b = w + k0 / 2 * PANEL * 4;
        _tile_loadd(4, x + k0, stride);
        _tile_loadd(6, b, 4 * PANEL);
        _tile_loadd(7, b + 2 * PANEL, 4 * PANEL);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x + TILE_ROWS * a->k + k0, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    amx_store(a, p, m0, 2, 1);
}

/* Up to this many rows, one row tile against two panels: a verification's few rows pad to
 * fewer zero rows in 16-row tiles than in pairs of them. */
#define FEW_ROWS 64
/* Past it, rows a block at a time, each thread its share of the panels in every block, so that a
 * block's rows stay in the core's L2 while the panels stream past them (all the rows of a long
 * prompt went through memory again for every panel). */
#define ROW_BLOCK 256
/* There, a weight in GGUF's blocks is dequantized this many panels at a time (about 1 MB of bf16
 * at K = 576), each once for all the rows. */
#define GROUP_PANELS 32

/* Whole tiles of rows are read from x in place, the rows after them from a copy padded with
 * zeros, so that no tile load reads past x. */
__attribute__((target("amx-tile,amx-bf16"))) static void run_amx(const Linear *a) {
    long span = a->m > FEW_ROWS ? 2 * TILE_ROWS : TILE_ROWS; /* rows per kernel call */
    long whole = a->m / span * span, left = a->m - whole;
    uint16_t *tail = aligned_alloc(64, span * a->k * 2);
    if (!tail) abort();
    memcpy(tail, (const uint16_t *)a->x + whole * a->k, left * a->k * 2);
    memset(tail + left * a->k, 0, (span - left) * a->k * 2);
    long num_panels = (a->n + PANEL - 1) / PANEL;
#define ROWS_AT(m0) ((m0) < whole ? (const uint16_t *)a->x + (m0) * a->k : tail)
#pragma omp parallel
    {
        long t = omp_get_thread_num(), num_threads = omp_get_num_threads();
        long begin = num_panels * t / num_threads, end = num_panels * (t + 1) / num_threads;
        configure_tiles();
        if (span == TILE_ROWS && a->blocks) /* each block dequantized into L1 as it is used */
            for (long p = begin; p < end; p += a->m <= TILE_ROWS ? 2 : 1)
                if (a->m <= TILE_ROWS)
                    amx_block_panels(a, ROWS_AT(0), p, p + 1 < end);
                else
                    for (long m0 = 0; m0 < a->m; m0 += 2 * TILE_ROWS)
                        amx_block_rows(a, ROWS_AT(m0),
                                       m0 + TILE_ROWS < a->m ? ROWS_AT(m0 + TILE_ROWS) : NULL, p,
                                       m0);
        else if (span == TILE_ROWS) /* two panels at a time, a last one alone */
            for (long p = begin; p < end; p += 2)
                for (long m0 = 0; m0 < a->m; m0 += TILE_ROWS)
                    amx_panels(a, ROWS_AT(m0), p, p + 1 < end, m0);
        else /* a weight in blocks: GROUP_PANELS of them dequantized at once, for every row */
            for (long g = begin; g < end; g += a->blocks ? GROUP_PANELS : end - begin) {
                long g_end = a->blocks && g + GROUP_PANELS < end ? g + GROUP_PANELS : end;
                const char *w = dequantized_panels(a, g, g_end);
                for (long block = 0; block < a->m; block += ROW_BLOCK)
                    for (long p = g; p < g_end; p++)
                        for (long m0 = block; m0 < a->m && m0 < block + ROW_BLOCK; m0 += span)
                            amx_rows(a, ROWS_AT(m0), w + (p - g) * a->k * PANEL * 2, p, m0);
                if (a->blocks) free((void *)w);
            }
        release_tiles();
    }
#undef ROWS_AT
    free(tail);
}

enum { F32, BF16, I8 };

static void run(const Linear *a, int format) {
    if (format == BF16 && a->k % TILE_K == 0 && amx_enabled()) {
        run_amx(a);
        return;
    }
    long num_panels = (a->n + PANEL - 1) / PANEL;
    if (format == BF16 && a->blocks && a->m >= 1 && a->m <= REGISTER_ROWS) {
        run_blocks_in_registers(a, num_panels);
        return;
    }
    long panel_bytes = a->k * PANEL * (format == F32 ? 4 : format == BF16 ? 2 : 1);
#pragma omp parallel for schedule(dynamic, 1)
    for (long p = 0; p < num_panels; p++) {
        const char *w = format == BF16 ? dequantized_panels(a, p, p + 1)
                                       : (const char *)a->w + p * panel_bytes;
        for (long m0 = 0; m0 < a->m; m0 += MAX_ROWS) {
            long rows = a->m - m0 < MAX_ROWS ? a->m - m0 : MAX_ROWS;
            if (format == BF16) {
                DISPATCH(panel_bf16, a, w, p, m0, rows);
            } else if (format == I8) {
                DISPATCH(panel_i8, a, w, p, m0, rows);
            } else {
                DISPATCH(panel_f32, a, w, p, m0, rows);
            }
        }
        if (a->blocks) free((void *)w);
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

/* x bf16, w GGUF's blocks (cpu_linear.pack_blocks, `format` their code) of a float32 weight,
 * multiplied as that weight rounded to bf16; out bf16: faser_linear_bf16's bits over the rounded
 * weight's panels. */
void faser_linear_blocks_bf16(const void *x, const uint8_t *w, const float *bias, void *out,
                              long m, long n, long k, int format) {
    Linear a = {x, w, NULL, bias, out, m, n, k, format};
    run(&a, BF16);
}
