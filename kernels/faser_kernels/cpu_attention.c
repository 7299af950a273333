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
 * them from L2), so verifying k + 1 positions costs little more than a decode. Tensors (q, caches,
 * out) are bf16 or fp32, all of one dtype:
 *   q, out: [num_tokens, num_heads, head_dim]
 *   caches: [num_blocks, block_size, num_kv_heads, head_dim]
 */
#include "cpu_tiles.h"
#include "cpu_vec.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_CHUNKS 8 /* head_dim <= 128: 8 vectors of 16 fp32 */
#define MAX_GROUP 8  /* query heads per kv head */
#define TILE 8       /* queries of one request per tile */
#define MAX_HEADS (TILE * MAX_GROUP)

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

/* Keys (or values) j0 .. j0 + n - 1 of the tile's kv head as fp32 rows: block[j][c]. */
static inline void read_block(const Attention *a, const Tile *tile, const void *cache, long j0,
                              long n, const long CHUNKS, __m512 block[16][MAX_CHUNKS]) {
    long b = j0 / a->block_size, offset = j0 % a->block_size;
    for (long j = 0; j < n; j++) {
        long slot = (long)tile->table[b] * a->block_size + offset;
        const void *row = at(a, cache, (slot * a->num_kv_heads + tile->kv_head) * a->head_dim);
        for (long c = 0; c < CHUNKS; c++) block[j][c] = load16(row, c * 16, a->head_dim, a->bf16);
        if (++offset == a->block_size) b++, offset = 0;
    }
}

/* Keys of positions at most pos_h that block j0 holds for a query head: 0 when none. */
static inline long keys_seen(long pos_h, long j0) {
    long n = pos_h + 1 - j0;
    return n <= 0 ? 0 : n < 16 ? n : 16;
}

/* Pass 1: every query head's scores, scale * q . k, and their maximum. */
static inline __attribute__((always_inline)) void score(const Attention *a, const Tile *tile,
                                                        float *max_score, const long CHUNKS) {
    long heads = (tile->t1 - tile->t0) * tile->group;
    __m512 top[MAX_HEADS];
    for (long h = 0; h < heads; h++) top[h] = _mm512_set1_ps(-INFINITY);
    for (long j0 = 0; j0 <= tile->last_pos; j0 += 16) {
        __m512 keys[16][MAX_CHUNKS];
        long n_block = keys_seen(tile->last_pos, j0);
        read_block(a, tile, a->k_cache, j0, n_block, CHUNKS, keys);
        for (long h = 0; h < heads; h++) {
            long t = tile->t0 + h / tile->group, n = keys_seen(tile->first + t, j0);
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
            __mmask16 m = tail_mask(n);
            __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(a->scale));
            _mm512_mask_storeu_ps(tile->scores + h * tile->width + j0, m, s);
            top[h] = _mm512_mask_max_ps(top[h], m, top[h], s);
        }
    }
    for (long h = 0; h < heads; h++) max_score[h] = _mm512_reduce_max_ps(top[h]);
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

/* Pass 3: every query head's values, weighted key by key in key order, into tile->acc. */
static inline __attribute__((always_inline)) void weigh(const Attention *a, const Tile *tile,
                                                        const long CHUNKS) {
    long heads = (tile->t1 - tile->t0) * tile->group, d = CHUNKS * 16;
    for (long h = 0; h < heads * d; h++) tile->acc[h] = 0.0f;
    for (long j0 = 0; j0 <= tile->last_pos; j0 += 16) {
        __m512 values[16][MAX_CHUNKS];
        read_block(a, tile, a->v_cache, j0, keys_seen(tile->last_pos, j0), CHUNKS, values);
        for (long h = 0; h < heads; h++) {
            long n = keys_seen(tile->first + tile->t0 + h / tile->group, j0);
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
}

static inline __attribute__((always_inline)) void attend_tile(const Attention *a, Tile *tile,
                                                              const long CHUNKS) {
    float max_score[MAX_HEADS], inv_sum[MAX_HEADS];
    long heads = (tile->t1 - tile->t0) * tile->group, d = a->head_dim;
    score(a, tile, max_score, CHUNKS);
    for (long h = 0; h < heads; h++)
        inv_sum[h] = normalise(tile->scores + h * tile->width,
                               tile->first + tile->t0 + h / tile->group, max_score[h]);
    weigh(a, tile, CHUNKS);
    for (long h = 0; h < heads; h++) {
        long t = tile->t0 + h / tile->group, head = tile->kv_head * tile->group + h % tile->group;
        void *out_row = (void *)at(a, a->out, (t * a->num_heads + head) * d);
        const float *acc = tile->acc + h * CHUNKS * 16;
        __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (long c = 0; c < CHUNKS; c++)
            store16(out_row, c * 16, d, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), inv),
                    a->bf16);
    }
}

/* CHUNKS as a constant, so that a query head's chunks live in registers */
static void attend(const Attention *a, Tile *tile) {
    switch ((a->head_dim + 15) / 16) {
    case 1: attend_tile(a, tile, 1); break;
    case 2: attend_tile(a, tile, 2); break;
    case 3: attend_tile(a, tile, 3); break;
    case 4: attend_tile(a, tile, 4); break;
    case 5: attend_tile(a, tile, 5); break;
    case 6: attend_tile(a, tile, 6); break;
    case 7: attend_tile(a, tile, 7); break;
    default: attend_tile(a, tile, 8); break;
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
    long *tiles = query_tiles(cu_seqlens_q, seq_lens, num_seqs, TILE, &num_tiles, &longest);
    long width = longest + 16, per_thread = TILE * group * (width + 16 * MAX_CHUNKS);
    float *scratch = malloc(sizeof(float) * per_thread * omp_get_max_threads());
    if (!tiles || !scratch) {
        free(tiles);
        free(scratch);
        return -2;
    }
    /* a query's bits depend on its own inputs only, so how tiles are shared out is free */
#pragma omp parallel for schedule(dynamic, 1)
    for (long item = 0; item < num_tiles * num_kv_heads; item++) {
        long i = item / num_kv_heads, s = tiles[2 * i];
        long q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        float *mine = scratch + per_thread * omp_get_thread_num();
        Tile tile = {.t0 = tiles[2 * i + 1], .kv_head = item % num_kv_heads, .group = group,
                     .table = block_tables + s * max_blocks, .scores = mine,
                     .acc = mine + TILE * group * width, .width = width};
        tile.t1 = tile.t0 + TILE < cu_seqlens_q[s + 1] ? tile.t0 + TILE : cu_seqlens_q[s + 1];
        tile.first = seq_lens[s] - q_len - cu_seqlens_q[s];
        tile.last_pos = tile.first + tile.t1 - 1;
        attend(&a, &tile);
    }
    free(tiles);
    free(scratch);
    return 0;
}
