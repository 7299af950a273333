/* Row-invariant float32 paged attention for x86 CPUs with AVX2 and FMA but no AVX-512, exported
 * as cpu_attention.c's faser_paged_attention (bf16 = 0 only).
 *
 * The same contract as cpu_attention.c: each (query token, head) walks its own request's keys
 * 0..pos in order, and every reduction runs in an order that depends only on pos and head_dim,
 * so a query gets the same bits whether it is a decode, one of k + 1 verified positions or a row
 * of a prefill chunk, and whatever else shares the batch. Keys go in blocks of 8: each key's dot
 * product is eight lane-wise FMA chains over the head (head_dim a multiple of 8), and the block's
 * eight keys are summed in one transposing tree that adds every key's lanes alike
 * (((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))), leaving the block's scores in one vector; the
 * weights exp(score - max) come from a fixed polynomial (cpu_vec_avx2.h's exp256), their sum in
 * eight lanes by key mod 8, and the values are weighted key by key (a head's eight chunks side by
 * side, eight independent FMA chains). As in cpu_attention.c, the work goes in tiles of up to TILE
 * queries of one request with the query heads of one kv head, which share each block of keys (and
 * of values) while it is in the cache; each query head still takes its keys in order, so the
 * tiling changes no bit. Each pass copies STAGE_KEYS rows at a time into a stage and reads them
 * from there, as cpu_attention.c does, and a tile of a few queries (decodes, verifications) takes
 * all its kv heads in one work item, so that their rows are read side by side.
 *   q, out: [num_tokens, num_heads, head_dim]
 *   caches: [num_blocks, block_size, num_kv_heads, head_dim]
 */
#include "cpu_tiles.h"
#include "cpu_vec_avx2.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEAD_DIM 128

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables;
    float *out;
    long max_blocks, block_size, num_heads, num_kv_heads, head_dim;
    float scale;
} Attention;

/* The row of position j of a request (block table `table`) for kv head h in a cache. */
static inline const float *cached(const Attention *a, const float *cache, const int32_t *table,
                                  long j, long h) {
    long slot = (long)table[j / a->block_size] * a->block_size + j % a->block_size;
    return cache + (slot * a->num_kv_heads + h) * a->head_dim;
}

/* Lane j of the result: the sum of vj's eight lanes, in the same tree for every j. By value:
 * accumulators in an array were stored back to memory at every step of their sums. */
static inline __m256 sum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5,
                          __m256 v6, __m256 v7) {
    __m256 t0 = _mm256_hadd_ps(v0, v1), t1 = _mm256_hadd_ps(v2, v3);
    __m256 t2 = _mm256_hadd_ps(v4, v5), t3 = _mm256_hadd_ps(v6, v7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* q . k_j for the eight keys at `keys` (a key past the query's position is a row of zeros), as
 * eight lane-wise FMA chains each, summed by sum8. */
static inline __m256 dots8(const float *q, const float *const keys[LANES], long chunks) {
    __m256 d0, d1, d2, d3, d4, d5, d6, d7;
    d0 = d1 = d2 = d3 = d4 = d5 = d6 = d7 = _mm256_setzero_ps();
    for (long c = 0, i = 0; c < chunks; c++, i += LANES) {
        __m256 qc = _mm256_loadu_ps(q + i);
        d0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[0] + i), d0);
        d1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[1] + i), d1);
        d2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[2] + i), d2);
        d3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[3] + i), d3);
        d4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[4] + i), d4);
        d5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[5] + i), d5);
        d6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[6] + i), d6);
        d7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[7] + i), d7);
    }
    return sum8(d0, d1, d2, d3, d4, d5, d6, d7);
}

#define TILE 8      /* queries of one request per tile */
#define MAX_GROUP 8  /* query heads per kv head */
#define MAX_HEADS (TILE * MAX_GROUP)
#define MAX_KV_RUN 8  /* kv heads per work item */
#define RUN_QUERIES TILE /* a tile of at most this many queries left in its request takes all
                              * its kv heads at once */

/* Queries [t0, t1) of a request (query t at position first + t) with the heads of kv_head; its
 * query heads are numbered h = (t - t0) * group + g. */
typedef struct {
    long t0, t1, first, kv_head, group, width;
    const int32_t *table;
    float *scores; /* [query heads, width] */
    float *acc;    /* [query heads, head_dim] */
    float *stage;  /* [STAGE_KEYS, run, head_dim]: rows copied from the cache, shared by a run */
} Tile;

#define STAGE_KEYS 64    /* keys copied to the stage at a time, a multiple of LANES */
#define PREFETCH_ROWS 16 /* rows the copy asks for ahead of the one it copies */

/* The rows of positions j0 .. min(j0 + STAGE_KEYS, last + 1) of the run of kv heads from the
 * tile's, copied into its stage when j0 starts a stage's worth (a tight loop of copies, where
 * reading the cache between the passes' arithmetic stalled on memory at every block); row
 * j0 + j's place in the stage, the run's heads side by side. A position's rows of the run lie
 * side by side in the cache too, so the copy reads them in one stream. It prefetches
 * PREFETCH_ROWS positions ahead: a request's blocks lie anywhere in the cache, so the hardware
 * prefetchers fall behind, and a long context read from memory (a decode, a verification)
 * waited on one row at a time. */
static inline const float *staged(const Attention *a, const Tile *tile, long run,
                                  const float *cache, long j0, long last) {
    long row = run * a->head_dim, at = j0 % STAGE_KEYS;
    if (at == 0)
        for (long j = 0; j < STAGE_KEYS && j0 + j <= last; j++) {
            if (j0 + j + PREFETCH_ROWS <= last) {
                const char *ahead = (const char *)cached(a, cache, tile->table,
                                                         j0 + j + PREFETCH_ROWS, tile->kv_head);
                for (long i = 0; i < row * (long)sizeof(float); i += 64)
                    _mm_prefetch(ahead + i, _MM_HINT_T0);
            }
            const float *src = cached(a, cache, tile->table, j0 + j, tile->kv_head);
            for (long i = 0; i < row; i += LANES)
                _mm256_storeu_ps(tile->stage + j * row + i, _mm256_loadu_ps(src + i));
        }
    return tile->stage + at * row;
}

/* Keys of positions at most pos that the block from j0 holds: 0 when none. */
static inline long keys_seen(long pos, long j0) {
    long n = pos + 1 - j0;
    return n <= 0 ? 0 : n < LANES ? n : LANES;
}

static inline long position(const Tile *tile, long h) {
    return tile->first + tile->t0 + h / tile->group;
}

static inline const float *query(const Attention *a, const Tile *tile, long h) {
    long t = tile->t0 + h / tile->group, head = tile->kv_head * tile->group + h % tile->group;
    return a->q + (t * a->num_heads + head) * a->head_dim;
}

/* Pass 1: every query head's scores, scale * q . k, for each tile of the run; returns their
 * maxima in `max_score`. */
static void score(const Attention *a, const Tile *tiles, long run, long heads,
                  float max_score[][MAX_HEADS]) {
    long d = a->head_dim, chunks = d / LANES, last = position(&tiles[0], heads - 1);
    __m256 top[MAX_KV_RUN][MAX_HEADS];
    for (long r = 0; r < run; r++)
        for (long h = 0; h < heads; h++) top[r][h] = _mm256_set1_ps(-INFINITY);
    static const float zeros[MAX_HEAD_DIM];
    for (long j0 = 0; j0 <= last; j0 += LANES) {
        const float *rows = staged(a, &tiles[0], run, a->k_cache, j0, last);
        for (long r = 0; r < run; r++) {
            const Tile *tile = &tiles[r];
            const float *keys[LANES], *mine[LANES];
            for (long j = 0; j < LANES; j++)
                keys[j] = j < keys_seen(last, j0) ? rows + (j * run + r) * d : zeros;
            for (long h = 0; h < heads; h++) {
                long n = keys_seen(position(tile, h), j0);
                if (!n) continue;
                for (long j = 0; j < LANES; j++) mine[j] = j < n ? keys[j] : zeros;
                __m256 s = _mm256_mul_ps(dots8(query(a, tile, h), mine, chunks),
                                         _mm256_set1_ps(a->scale));
                _mm256_storeu_ps(tile->scores + h * tile->width + j0, s);
                top[r][h] = _mm256_blendv_ps(top[r][h], _mm256_max_ps(top[r][h], s), first(n));
            }
        }
    }
    for (long r = 0; r < run; r++)
        for (long h = 0; h < heads; h++) {
            float lanes[LANES];
            _mm256_storeu_ps(lanes, top[r][h]);
            max_score[r][h] = lanes[0];
            for (int l = 1; l < LANES; l++)
                max_score[r][h] = lanes[l] > max_score[r][h] ? lanes[l] : max_score[r][h];
        }
}

/* Pass 2: a query head's scores become exp(score - max) in place; returns 1 / their sum. */
static float normalise(float *scores, long pos, float max_score) {
    __m256 sum = _mm256_setzero_ps();
    for (long j0 = 0; j0 <= pos; j0 += LANES) {
        __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j0), _mm256_set1_ps(max_score)));
        p = _mm256_and_ps(p, first(pos + 1 - j0));
        _mm256_storeu_ps(scores + j0, p);
        sum = _mm256_add_ps(sum, p);
    }
    return 1.0f / sum_lanes(sum);
}

#define WEIGH_FMA(r, c) r = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + (c) * LANES), r);

/* out[0 .. 8 LANES) += p[j] * rows[j][at ..] for the first n rows (d apart) in key order: eight
 * chunks' sums side by side, so that eight FMA chains, not one, wait on their latency, and in
 * registers through all n keys. */
static inline void weigh8(float *out, const float *p, const float *rows, long d, long at,
                          long n) {
    __m256 a0 = _mm256_loadu_ps(out), a1 = _mm256_loadu_ps(out + LANES),
           a2 = _mm256_loadu_ps(out + 2 * LANES), a3 = _mm256_loadu_ps(out + 3 * LANES),
           a4 = _mm256_loadu_ps(out + 4 * LANES), a5 = _mm256_loadu_ps(out + 5 * LANES),
           a6 = _mm256_loadu_ps(out + 6 * LANES), a7 = _mm256_loadu_ps(out + 7 * LANES);
    for (long j = 0; j < n; j++) {
        __m256 pj = _mm256_set1_ps(p[j]);
        const float *v = rows + j * d + at;
        WEIGH_FMA(a0, 0) WEIGH_FMA(a1, 1) WEIGH_FMA(a2, 2) WEIGH_FMA(a3, 3)
        WEIGH_FMA(a4, 4) WEIGH_FMA(a5, 5) WEIGH_FMA(a6, 6) WEIGH_FMA(a7, 7)
    }
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + LANES, a1);
    _mm256_storeu_ps(out + 2 * LANES, a2);
    _mm256_storeu_ps(out + 3 * LANES, a3);
    _mm256_storeu_ps(out + 4 * LANES, a4);
    _mm256_storeu_ps(out + 5 * LANES, a5);
    _mm256_storeu_ps(out + 6 * LANES, a6);
    _mm256_storeu_ps(out + 7 * LANES, a7);
}

/* Pass 3: every query head's values, weighted key by key in key order, into its tile's acc: a
 * stage of keys at a time, each head's sums kept in registers through the stage. */
static void weigh(const Attention *a, const Tile *tiles, long run, long heads) {
    long d = a->head_dim, chunks = d / LANES, last = position(&tiles[0], heads - 1);
    for (long r = 0; r < run; r++)
        for (long i = 0; i < heads * d; i++) tiles[r].acc[i] = 0.0f;
    for (long j0 = 0; j0 <= last; j0 += STAGE_KEYS) {
        const float *staged_rows = staged(a, &tiles[0], run, a->v_cache, j0, last);
        for (long r = 0; r < run; r++) {
            const Tile *tile = &tiles[r];
            const float *rows = staged_rows + r * d;
            for (long h = 0; h < heads; h++) {
                long n = position(tile, h) + 1 - j0;
                if (n <= 0) continue;
                n = n < STAGE_KEYS ? n : STAGE_KEYS;
                const float *p = tile->scores + h * tile->width + j0;
                float *out = tile->acc + h * d;
                long c = 0, i = 0;
                for (; c + 8 <= chunks; c += 8, i += 8 * LANES)
                    weigh8(out + i, p, rows, run * d, i, n);
                /* chunk by chunk, so that each sum stays in one register through the stage */
                for (; c < chunks; c++, i += LANES) {
                    __m256 acc = _mm256_loadu_ps(out + i);
                    for (long j = 0; j < n; j++)
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]),
                                              _mm256_loadu_ps(rows + j * run * d + i), acc);
                    _mm256_storeu_ps(out + i, acc);
                }
            }
        }
    }
}

/* A run of tiles: the same queries with kv heads tiles[0].kv_head .. + run - 1. */
static void attend(const Attention *a, const Tile *tiles, long run) {
    long heads = (tiles[0].t1 - tiles[0].t0) * tiles[0].group, d = a->head_dim;
    float max_score[MAX_KV_RUN][MAX_HEADS], inv_sum[MAX_KV_RUN][MAX_HEADS];
    score(a, tiles, run, heads, max_score);
    for (long r = 0; r < run; r++)
        for (long h = 0; h < heads; h++)
            inv_sum[r][h] = normalise(tiles[r].scores + h * tiles[r].width,
                                      position(&tiles[r], h), max_score[r][h]);
    weigh(a, tiles, run, heads);
    for (long r = 0; r < run; r++)
        for (long h = 0; h < heads; h++) {
            const Tile *tile = &tiles[r];
            float *out = (float *)query(a, tile, h) - a->q + a->out;
            __m256 inv = _mm256_set1_ps(inv_sum[r][h]);
            for (long c = 0; c < d / LANES; c++)
                _mm256_storeu_ps(out + c * LANES, _mm256_mul_ps(
                                     _mm256_loadu_ps(tile->acc + h * d + c * LANES), inv));
        }
}

int faser_paged_attention(const void *q, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, const int32_t *seq_lens,
                          const int32_t *cu_seqlens_q, void *out, long num_seqs, long max_blocks,
                          long block_size, long num_heads, long num_kv_heads, long head_dim,
                          float scale, int bf16) {
    if (bf16 || head_dim > MAX_HEAD_DIM || head_dim % LANES || num_heads % num_kv_heads)
        return -1;
    Attention a = {q, k_cache, v_cache, block_tables, out, max_blocks, block_size, num_heads,
                   num_kv_heads, head_dim, scale};
    long num_tiles = 0, longest = 0, group = num_heads / num_kv_heads;
    if (group > MAX_GROUP) return -1;
    long *tiles = query_tiles(cu_seqlens_q, seq_lens, num_seqs, TILE, &num_tiles, &longest);
    long width = (longest + LANES) / LANES * LANES;
    /* A tile of a few queries (decodes, verifications) reads each key for few query heads, so
     * its time goes to reading the cache: it takes all its kv heads in one work item, their rows
     * read side by side, while there are tiles enough to keep every thread busy. A prefill
     * chunk's tiles share each key among many query heads and keep an item per kv head: in runs
     * they took longer (docs/performance.md). */
    long all = 1;
    if (num_tiles >= 2 * omp_get_max_threads() && num_kv_heads <= MAX_KV_RUN)
        for (long s = 0; s < num_seqs && all == 1; s++)
            if (cu_seqlens_q[s + 1] - cu_seqlens_q[s] <= RUN_QUERIES) all = num_kv_heads;
    long per_tile = TILE * group * (width + head_dim);
    long per_thread = per_tile * all + STAGE_KEYS * all * head_dim;
    float *scratch = malloc(sizeof(float) * per_thread * omp_get_max_threads());
    long *items = malloc(sizeof(long) * 3 * (num_tiles * num_kv_heads + 1));
    if (!tiles || !scratch || !items) {
        free(tiles);
        free(scratch);
        free(items);
        return -2;
    }
    long num_items = 0;
    for (long i = 0; i < num_tiles; i++) {
        long s = tiles[2 * i], t0 = tiles[2 * i + 1];
        long run = cu_seqlens_q[s + 1] - t0 <= RUN_QUERIES ? all : 1;
        for (long kv0 = 0; kv0 < num_kv_heads; kv0 += run, num_items++)
            items[3 * num_items] = i, items[3 * num_items + 1] = kv0,
            items[3 * num_items + 2] = run;
    }
    /* a query's bits depend on its own inputs only, so how tiles are shared out is free */
#pragma omp parallel for schedule(dynamic, 1)
    for (long item = 0; item < num_items; item++) {
        long i = items[3 * item], kv0 = items[3 * item + 1], run = items[3 * item + 2];
        long s = tiles[2 * i];
        float *mine = scratch + per_thread * omp_get_thread_num();
        Tile run_tiles[MAX_KV_RUN];
        for (long r = 0; r < run; r++) {
            Tile *tile = &run_tiles[r];
            *tile = (Tile){.t0 = tiles[2 * i + 1], .kv_head = kv0 + r, .group = group,
                           .width = width, .table = block_tables + s * max_blocks,
                           .scores = mine + r * per_tile,
                           .acc = mine + r * per_tile + TILE * group * width,
                           .stage = mine + run * per_tile};
            tile->t1 = tile->t0 + TILE < cu_seqlens_q[s + 1] ? tile->t0 + TILE
                                                             : cu_seqlens_q[s + 1];
            tile->first =
                seq_lens[s] - (cu_seqlens_q[s + 1] - cu_seqlens_q[s]) - cu_seqlens_q[s];
        }
        attend(&a, run_tiles, run);
    }
    free(tiles);
    free(scratch);
    free(items);
    return 0;
}
