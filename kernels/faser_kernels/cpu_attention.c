/* Row-invariant paged attention for x86 CPUs with AVX-512.
 *
 * Each (query token, head) walks its own request's keys 0..pos in order: scores in fp32 (each a
 * lane-wise FMA chain over the head's 16-wide chunks, then one fixed tree over the lanes), their
 * maximum, exp and sum, then the values weighted key by key. Every reduction runs in an order
 * that depends only on pos, so a query gets the same bits whether it is a decode, one of k + 1
 * verified positions or a row of a prefill chunk, and whatever else shares the batch.
 *
 * The work goes in tiles: up to TILE queries of one request with the heads that share a kv head.
 * A block of 16 keys (or values) is read once per tile, widened to fp32, and used by every query
 * head of the tile before the next block. Each query head still takes its keys in order, so the
 * tiling changes no bit; it spares re-reading the keys per query (attention was bound by reading
 * them from L2), so verifying k + 1 positions costs little more than a decode.
 *
 * Memory: a work item takes a tile's run of kv heads (all of them while there are tiles enough to
 * keep every thread busy), and each pass first copies STAGE_KEYS keys' rows of the run into a
 * small stage, then computes from it. Read in the passes' own order, block by block between long
 * stretches of arithmetic, the cache stalled on memory at every block (its blocks lie anywhere);
 * a tight loop of copies keeps the hardware prefetchers ahead of it, and the run's rows of a key
 * lie side by side. Neither changes a bit: each query head's arithmetic is the same.
 *
 * Where the CPU has AMX, every bf16 call takes pass 1's scores from the tiles instead (below): a
 * query's bits depend on its own inputs only there too, but they are not the vector path's.
 *
 * Tensors (q, caches, out) are bf16 or fp32, all of one dtype:
 *   q, out: [num_tokens, num_heads, head_dim]
 *   caches: [num_blocks, block_size, num_kv_heads, head_dim]
 */
#include "cpu_amx.h"
#include "cpu_tiles.h"
#include "cpu_vec.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CHUNKS 8  /* head_dim <= 128: 8 vectors of 16 fp32 */
#define MAX_GROUP 8   /* query heads per kv head */
#define TILE 8        /* queries of one request per tile */
#define MAX_HEADS (TILE * MAX_GROUP)
#define MAX_KV_RUN 8  /* kv heads per work item */
#define STAGE_KEYS 64 /* keys copied to the stage at a time */
#define PREFETCH_ROWS 16 /* positions the copy asks for ahead of the one it copies */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens, *cu_seqlens_q;
    void *out;
    long num_seqs, max_blocks, block_size, num_heads, num_kv_heads, head_dim;
    float scale;
    int bf16;
} Attention;

/* One tile: queries [t0, t1) of a request (query t at position first + t) and the heads of
 * kv_head; its query heads are numbered h = (t - t0) * group + g. */
typedef struct {
    long t0, t1, first, kv_head, group, last_pos;
    const int32_t *table;
    float *scores; /* [num query heads, width] */
    float *acc;    /* [num query heads, CHUNKS * 16] */
    long width;
    long pos[MAX_HEADS]; /* query head h's position: first + t0 + h / group, divided once */
} Tile;

static inline const void *at(const Attention *a, const void *base, long offset) {
    return a->bf16 ? (const void *)((const uint16_t *)base + offset)
                   : (const void *)((const float *)base + offset);
}

/* The 16 sums of v[0..15]'s lanes, in key order: lane j gets key j's sum. Every key's lanes are
 * added in the same tree (e + 8, then + 4, + 2, + 1 apart), whatever its place among the 16. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* [key 2i: 8 lanes | key 2i + 1: 8 lanes] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* 128-bit chunk c: 4 lanes of key 4i + c */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* chunk c: 2 lanes of key 8i + c, 2 of key 8i + 4 + c */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xee));
    /* chunk c: keys c, 4 + c, 8 + c, 12 + c; lane 4c + t holds key 4t + c */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                             _mm512_shuffle_ps(y[0], y[1], 0xdd));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
}

/* Copies keys (or values) j0 .. j0 + n - 1 of kv heads kv0 .. kv0 + run - 1 into `stage`, as
 * [n][run][head_dim]: a tight loop of copies, where reading the cache in the passes' own order
 * would stall on memory block by block. It prefetches the rows PREFETCH_ROWS positions ahead (up
 * to `last`, the request's last): a request's blocks lie anywhere in the cache, so the hardware
 * prefetchers fall behind at every block. */
static void stage_rows(const Attention *a, const int32_t *table, const void *cache, long j0,
                       long n, long last, long kv0, long run, void *stage) {
    long elt = a->bf16 ? 2 : 4, row = run * a->head_dim * elt;
    long stride = a->num_kv_heads * a->head_dim * elt;
    const char *base = (const char *)cache + kv0 * a->head_dim * elt;
    char *out = stage;
    for (long j = 0; j < n;) {
        long b = (j0 + j) / a->block_size, offset = (j0 + j) % a->block_size;
        long len = a->block_size - offset < n - j ? a->block_size - offset : n - j;
        const char *src = base + ((long)table[b] * a->block_size + offset) * stride;
        for (long p = j0 + j + PREFETCH_ROWS; p < j0 + j + PREFETCH_ROWS + len && p <= last; p++) {
            long block = table[p / a->block_size];
            const char *ahead = base + (block * a->block_size + p % a->block_size) * stride;
            for (long byte = 0; byte < row; byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
        }
        if (row == stride)
            memcpy(out, src, len * row);
        else
            for (long i = 0; i < len; i++) memcpy(out + i * row, src + i * stride, row);
        out += len * row, j += len;
    }
}

/* Rows 0 .. n - 1 of a kv head in the stage (row i at element i * stride) as fp32: block[i][c]. */
static inline void read_rows(const Attention *a, const void *rows, long stride, long n,
                             const long CHUNKS, __m512 block[16][MAX_CHUNKS]) {
    for (long i = 0; i < n; i++) {
        const void *row = at(a, rows, i * stride);
        for (long c = 0; c < CHUNKS; c++) block[i][c] = load16(row, c * 16, a->head_dim, a->bf16);
    }
}

/* Keys of positions at most pos_h that block j0 holds for a query head: 0 when none. */
static inline long keys_seen(long pos_h, long j0) {
    long n = pos_h + 1 - j0;
    return n <= 0 ? 0 : n < 16 ? n : 16;
}

/* A query head's scaled scores s of a block's first keys (m) into its row, and into its maximum. */
static inline void keep_scores(float *row, __mmask16 m, __m512 s, __m512 *top) {
    _mm512_mask_storeu_ps(row, m, s);
    *top = _mm512_mask_max_ps(*top, m, *top, s);
}

/* Pass 1, one block: every query head's scores against keys j0 .. j0 + 15 (`rows`, staged),
 * scale * q . k, and their running maximum in top[h]. */
static inline __attribute__((always_inline)) void score_block(const Attention *a,
                                                              const Tile *tile, long j0,
                                                              const void *rows, long stride,
                                                              __m512 *top, const long CHUNKS) {
    long heads = (tile->t1 - tile->t0) * tile->group;
    __m512 keys[16][MAX_CHUNKS];
    read_rows(a, rows, stride, keys_seen(tile->last_pos, j0), CHUNKS, keys);
    for (long h = 0; h < heads; h++) {
        long t = tile->t0 + h / tile->group, n = keys_seen(tile->pos[h], j0);
        if (!n) continue;
        long head = tile->kv_head * tile->group + h % tile->group;
        const void *q_row = at(a, a->q, (t * a->num_heads + head) * a->head_dim);
        __m512 q[MAX_CHUNKS], dots[16];
        for (long c = 0; c < CHUNKS; c++) q[c] = load16(q_row, c * 16, a->head_dim, a->bf16);
        for (long j = 0; j < 16; j++) {
            __m512 dot = _mm512_setzero_ps();
            for (long c = 0; j < n && c < CHUNKS; c++)
                dot = _mm512_fmadd_ps(q[c], keys[j][c], dot);
            dots[j] = dot;
        }
        __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(a->scale));
        keep_scores(tile->scores + h * tile->width + j0, tail_mask(n), s, &top[h]);
    }
}

/* Pass 2: a query head's scores become exp(score - max) in place; returns 1 / their sum. */
static inline float normalise(float *scores, long pos, float max_score) {
    __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(max_score);
    for (long j = 0; j <= pos; j += 16) {
        __mmask16 m = tail_mask(pos + 1 - j);
        __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), top));
        p = _mm512_maskz_mov_ps(m, p);
        _mm512_mask_storeu_ps(scores + j, m, p);
        sum = _mm512_add_ps(sum, p);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* Pass 3, one block: every query head's values j0 .. j0 + 15 (`rows`, staged), weighted key by
 * key in key order, added into tile->acc. */
static inline __attribute__((always_inline)) void weigh_block(const Attention *a,
                                                              const Tile *tile, long j0,
                                                              const void *rows, long stride,
                                                              const long CHUNKS) {
    long heads = (tile->t1 - tile->t0) * tile->group, d = CHUNKS * 16;
    __m512 values[16][MAX_CHUNKS];
    read_rows(a, rows, stride, keys_seen(tile->last_pos, j0), CHUNKS, values);
    for (long h = 0; h < heads; h++) {
        long n = keys_seen(tile->pos[h], j0);
        const float *p = tile->scores + h * tile->width + j0;
        __m512 acc[MAX_CHUNKS];
        for (long c = 0; c < CHUNKS; c++) acc[c] = _mm512_loadu_ps(tile->acc + h * d + c * 16);
        for (long j = 0; j < n; j++) {
            __m512 weight = _mm512_set1_ps(p[j]);
            for (long c = 0; c < CHUNKS; c++)
                acc[c] = _mm512_fmadd_ps(weight, values[j][c], acc[c]);
        }
        for (long c = 0; c < CHUNKS; c++) _mm512_storeu_ps(tile->acc + h * d + c * 16, acc[c]);
    }
}

/* -- Pass 1 on AMX (bf16) -----------------------------------------------------------------------
 * A block's scores for all of a tile's query heads in tile products: the heads' queries (16 rows
 * of 32 dims a tile, pack_queries) times the 16 keys' dims in pairs (transpose_keys), each score
 * one query head's and one key's dims summed in the tiles' fixed order, then scaled, masked and
 * taken into the maximum as on the vector path. Passes 2 and 3 are the vector path's. */

#define AMX_HEADS 48 /* query heads per tile: three tiles of 16 rows */

/* The tile's query heads, row h query head h: [AMX_HEADS][head_dim] bf16, zero past them. */
static void pack_queries(const Attention *a, const Tile *tile, uint16_t *packed) {
    long heads = (tile->t1 - tile->t0) * tile->group, d = a->head_dim;
    memset(packed, 0, sizeof(uint16_t) * AMX_HEADS * d);
    for (long h = 0; h < heads; h++) {
        long t = tile->t0 + h / tile->group;
        long head = tile->kv_head * tile->group + h % tile->group;
        memcpy(packed + h * d, (const uint16_t *)a->q + (t * a->num_heads + head) * d, 2 * d);
    }
}

/* 16 rows of 16 32-bit lanes transposed in registers: r[i][j] becomes r[j][i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
    }
}

/* 16 keys' rows (`stride` elements apart) as the products' second operand: [head_dim / 2][16]
 * pairs of dims, column j key j. Rows past the staged keys hold whatever the stage held: their
 * columns' scores are never read. */
static inline void transpose_keys(const uint16_t *keys, long stride, long d, uint32_t *kt) {
    for (long p0 = 0; p0 < d / 2; p0 += 16) {
        __m512i r[16];
        for (long j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(keys + j * stride + 2 * p0);
        transpose16(r);
        for (long p = 0; p < 16; p++) _mm512_storeu_si512(kt + (p0 + p) * 16, r[p]);
    }
}

/* One row tile's scores: rows r0 .. r0 + 15 of `packed` against the transposed keys, stored
 * [row][16 keys] `width` floats apart. */
#define AMX_ROWS(r0, c)                                                                            \
    do {                                                                                           \
        _tile_zero(c);                                                                             \
        for (long k = 0; k < d; k += TILE_K) {                                                     \
            _tile_loadd(3, packed + (r0) * d + k, 2 * d);                                          \
            _tile_loadd(4, kt + k / 2 * 16, 64);                                                   \
            _tile_dpbf16ps(c, 3, 4);                                                               \
        }                                                                                          \
        _tile_stored(c, scores + (r0) * tile->width, 4 * tile->width);                             \
    } while (0)

/* Pass 1, one block, on AMX: as score_block, the dot products from the tiles. */
__attribute__((target("amx-tile,amx-bf16"))) static void score_block_amx(
    const Attention *a, const Tile *tile, long j0, const void *rows, long stride,
    const uint16_t *packed, __m512 *top) {
    long heads = (tile->t1 - tile->t0) * tile->group, d = a->head_dim;
    uint32_t kt[8 * MAX_CHUNKS * 16] __attribute__((aligned(64)));
    transpose_keys(rows, stride, d, kt);
    float *scores = tile->scores + j0;
    AMX_ROWS(0, 0);
    if (heads > 16) AMX_ROWS(16, 1);
    if (heads > 32) AMX_ROWS(32, 2);
    __m512 scale = _mm512_set1_ps(a->scale);
    for (long h = 0; h < heads; h++) {
        long n = keys_seen(tile->pos[h], j0);
        if (!n) continue;
        __mmask16 m = tail_mask(n);
        float *row = tile->scores + h * tile->width + j0;
        keep_scores(row, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row), scale), &top[h]);
    }
}
#undef AMX_ROWS

/* -- Pass 3 on AMX (bf16) -----------------------------------------------------------------------
 * A group of 32 keys' values weighted for all of a tile's query heads in tile products: the
 * heads' weights rounded to bf16, zero past each head's query (16 rows of 32 keys a tile), times
 * the values in pairs of keys (16 dims a tile), added into tile->acc, whose rows are the
 * products' rows. A head's sums take its keys' pairs in order, group after group, so its bits
 * depend on its own inputs only; a weight of 0 adds nothing, and the values past the last key
 * are zeros, not whatever the stage held. */

#define PAIR_KEYS 32 /* keys per group: a tile row of bf16 weights */

static inline __mmask16 first_lanes(long n) { return n <= 0 ? 0 : tail_mask(n); }

/* Keys j0 .. j0 + 31's values (`rows`, `stride` elements apart; the first n real) in pairs of
 * keys: [head_dim / 16][16 pairs][16 dims x 2] bf16, the products' second operands. */
static inline void pair_values(const uint16_t *rows, long stride, long n, long d,
                               uint16_t *paired) {
    __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                   39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (long p = 0; p < PAIR_KEYS / 2; p++)
        for (long c = 0; c < d; c += 32) {
            __m512i v0 = 2 * p < n ? _mm512_loadu_si512(rows + 2 * p * stride + c)
                                   : _mm512_setzero_si512();
            __m512i v1 = 2 * p + 1 < n ? _mm512_loadu_si512(rows + (2 * p + 1) * stride + c)
                                       : _mm512_setzero_si512();
            _mm512_storeu_si512(paired + (c / 16 * 16 + p) * 32,
                                _mm512_permutex2var_epi16(v0, low, v1));
            _mm512_storeu_si512(paired + ((c / 16 + 1) * 16 + p) * 32,
                                _mm512_permutex2var_epi16(v0, high, v1));
        }
}

/* Pass 3, one group of 32 keys, on AMX: as weigh_block. */
__attribute__((target("amx-tile,amx-bf16"))) static void weigh_group_amx(
    const Attention *a, const Tile *tile, long j0, const void *rows, long stride) {
    long heads = (tile->t1 - tile->t0) * tile->group, d = a->head_dim;
    long groups = (heads + 15) / 16, n = tile->last_pos + 1 - j0;
    uint16_t paired[MAX_CHUNKS * 16 * PAIR_KEYS] __attribute__((aligned(64)));
    uint16_t weights[AMX_HEADS * PAIR_KEYS] __attribute__((aligned(64)));
    pair_values(rows, stride, n < PAIR_KEYS ? n : PAIR_KEYS, d, paired);
    for (long h = 0; h < groups * 16; h++) {
        long seen = h < heads ? tile->pos[h] + 1 - j0 : 0;
        const float *p = tile->scores + h * tile->width + j0;
        __m512 w0 = _mm512_maskz_loadu_ps(first_lanes(seen), p);
        __m512 w1 = _mm512_maskz_loadu_ps(first_lanes(seen - 16), p + 16);
        _mm512_storeu_si512(weights + h * PAIR_KEYS, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
    for (long g = 0; g < groups; g++) {
        _tile_loadd(3, weights + g * 16 * PAIR_KEYS, 2 * PAIR_KEYS);
        for (long c = 0; c < d; c += 16) {
            float *acc = tile->acc + g * 16 * d + c;
            _tile_loadd(0, acc, 4 * d);
            _tile_loadd(4, paired + c * 32, 64);
            _tile_dpbf16ps(0, 3, 4);
            _tile_stored(0, acc, 4 * d);
        }
    }
}

/* The tiles of one request's queries for a run of kv heads, one tile per kv head: each pass
 * stages STAGE_KEYS keys' rows of the run at a time, then takes them block by block, every kv
 * head of the run in each block. */
static inline __attribute__((always_inline)) void attend_tiles(const Attention *a, Tile *tiles,
                                                               long num, void *stage,
                                                               uint16_t *packed,
                                                               const long CHUNKS) {
    long heads = (tiles[0].t1 - tiles[0].t0) * tiles[0].group, d = a->head_dim;
    __m512 top[MAX_KV_RUN][MAX_HEADS];
    for (long i = 0; i < num; i++) {
        for (long h = 0; h < heads; h++) top[i][h] = _mm512_set1_ps(-INFINITY);
        for (long x = 0; x < heads * CHUNKS * 16; x++) tiles[i].acc[x] = 0.0f;
        if (packed) pack_queries(a, &tiles[i], packed + i * AMX_HEADS * d);
    }
    if (packed) configure_tiles();
    long last_pos = tiles[0].last_pos, kv0 = tiles[0].kv_head, stride = num * d;
    for (long g0 = 0; g0 <= last_pos; g0 += STAGE_KEYS) {
        long n = last_pos + 1 - g0 < STAGE_KEYS ? last_pos + 1 - g0 : STAGE_KEYS;
        stage_rows(a, tiles[0].table, a->k_cache, g0, n, last_pos, kv0, num, stage);
        for (long j0 = g0; j0 < g0 + n; j0 += 16)
            for (long i = 0; i < num; i++) {
                const void *keys = at(a, stage, (j0 - g0) * stride + i * d);
                if (packed)
                    score_block_amx(a, &tiles[i], j0, keys, stride,
                                    packed + i * AMX_HEADS * d, top[i]);
                else
                    score_block(a, &tiles[i], j0, keys, stride, top[i], CHUNKS);
            }
    }
    if (packed) release_tiles();
    float inv_sum[MAX_KV_RUN][MAX_HEADS];
    for (long i = 0; i < num; i++)
        for (long h = 0; h < heads; h++)
            inv_sum[i][h] = normalise(tiles[i].scores + h * tiles[i].width,
                                      tiles[i].pos[h],
                                      _mm512_reduce_max_ps(top[i][h]));
    if (packed) configure_tiles();
    for (long g0 = 0; g0 <= last_pos; g0 += STAGE_KEYS) {
        long n = last_pos + 1 - g0 < STAGE_KEYS ? last_pos + 1 - g0 : STAGE_KEYS;
        stage_rows(a, tiles[0].table, a->v_cache, g0, n, last_pos, kv0, num, stage);
        for (long j0 = g0; j0 < g0 + n; j0 += packed ? PAIR_KEYS : 16)
            for (long i = 0; i < num; i++) {
                const void *values = at(a, stage, (j0 - g0) * stride + i * d);
                if (packed)
                    weigh_group_amx(a, &tiles[i], j0, values, stride);
                else
                    weigh_block(a, &tiles[i], j0, values, stride, CHUNKS);
            }
    }
    if (packed) release_tiles();
    for (long i = 0; i < num; i++) {
        const Tile *tile = &tiles[i];
        for (long h = 0; h < heads; h++) {
            long t = tile->t0 + h / tile->group;
            long head = tile->kv_head * tile->group + h % tile->group;
            void *out_row = (void *)at(a, a->out, (t * a->num_heads + head) * d);
            const float *acc = tile->acc + h * CHUNKS * 16;
            __m512 inv = _mm512_set1_ps(inv_sum[i][h]);
            for (long c = 0; c < CHUNKS; c++)
                store16(out_row, c * 16, d, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), inv),
                        a->bf16);
        }
    }
}

/* CHUNKS as a constant, so that a query head's chunks live in registers */
static void attend(const Attention *a, Tile *tiles, long num, void *stage, uint16_t *packed) {
    switch ((a->head_dim + 15) / 16) {
    case 1: attend_tiles(a, tiles, num, stage, packed, 1); break;
    case 2: attend_tiles(a, tiles, num, stage, packed, 2); break;
    case 3: attend_tiles(a, tiles, num, stage, packed, 3); break;
    case 4: attend_tiles(a, tiles, num, stage, packed, 4); break;
    case 5: attend_tiles(a, tiles, num, stage, packed, 5); break;
    case 6: attend_tiles(a, tiles, num, stage, packed, 6); break;
    case 7: attend_tiles(a, tiles, num, stage, packed, 7); break;
    default: attend_tiles(a, tiles, num, stage, packed, 8); break;
    }
}

int faser_paged_attention(const void *q, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, const int32_t *seq_lens,
                          const int32_t *cu_seqlens_q, void *out, long num_seqs, long max_blocks,
                          long block_size, long num_heads, long num_kv_heads, long head_dim,
                          float scale, int bf16) {
    if (head_dim > 16 * MAX_CHUNKS || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > MAX_GROUP)
        return -1;
    Attention a = {q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, num_seqs,
                   max_blocks, block_size, num_heads, num_kv_heads, head_dim, scale, bf16};
    long num_tiles = 0, longest = 0, group = num_heads / num_kv_heads;
    /* every bf16 call of such a CPU, whatever its shape: a query's bits must not depend on it */
    int amx = bf16 && head_dim % TILE_K == 0 && amx_enabled();
    long tile_queries = amx ? AMX_HEADS / group : TILE;
    /* a tile's rows of scores and sums: on AMX all 48, as its products write whole tiles */
    long tile_rows = amx ? AMX_HEADS : tile_queries * group;
    long *tiles = query_tiles(cu_seqlens_q, seq_lens, num_seqs, tile_queries, &num_tiles,
                              &longest);
    /* a run of kv heads per work item while there are tiles enough to keep every thread busy;
     * else one, so that a lone request's kv heads still share the threads */
    long run = num_tiles >= 2 * omp_get_max_threads() ? num_kv_heads : 1;
    run = run < MAX_KV_RUN ? run : MAX_KV_RUN;
    long runs = (num_kv_heads + run - 1) / run;
    long width = longest + 16, per_tile = tile_rows * (width + 16 * MAX_CHUNKS);
    long stage_size = STAGE_KEYS * run * 16 * MAX_CHUNKS;
    long packed = amx ? run * AMX_HEADS * head_dim / 2 : 0; /* pack_queries' bf16, as floats */
    long per_thread = per_tile * run + stage_size + packed;
    float *scratch = malloc(sizeof(float) * per_thread * omp_get_max_threads());
    if (!tiles || !scratch) {
        free(tiles);
        free(scratch);
        return -2;
    }
    /* a query's bits depend on its own inputs only, so how tiles are shared out is free */
#pragma omp parallel for schedule(dynamic, 1)
    for (long item = 0; item < num_tiles * runs; item++) {
        long i = item / runs, s = tiles[2 * i], kv0 = item % runs * run;
        long q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        long num = kv0 + run <= num_kv_heads ? run : num_kv_heads - kv0;
        float *mine = scratch + per_thread * omp_get_thread_num();
        Tile run_tiles[MAX_KV_RUN];
        for (long k = 0; k < num; k++) {
            Tile *tile = &run_tiles[k];
            *tile = (Tile){.t0 = tiles[2 * i + 1], .kv_head = kv0 + k, .group = group,
                           .table = block_tables + s * max_blocks,
                           .scores = mine + per_tile * k,
                           .acc = mine + per_tile * k + tile_rows * width, .width = width};
            tile->t1 = tile->t0 + tile_queries < cu_seqlens_q[s + 1] ? tile->t0 + tile_queries
                                                                     : cu_seqlens_q[s + 1];
            tile->first = seq_lens[s] - q_len - cu_seqlens_q[s];
            tile->last_pos = tile->first + tile->t1 - 1;
            for (long h = 0; h < (tile->t1 - tile->t0) * group; h++)
                tile->pos[h] = tile->first + tile->t0 + h / group;
        }
        float *stage = mine + per_tile * run;
        attend(&a, run_tiles, num, stage, amx ? (uint16_t *)(stage + stage_size) : NULL);
    }
    free(tiles);
    free(scratch);
    return 0;
}
