/* Row-invariant paged attention for x86 CPUs with AVX-512.
 *
 * Each (query token, head) walks its own request's keys 0..pos in order (the heads that share a
 * kv head walk them together, each key loaded once):
 * scores in fp32, their maximum, exp and sum, then the weighted sum of values, every reduction in
 * a fixed order that depends only on pos. A query therefore gets the same bits whether it is a
 * decode, one of k + 1 verified positions or a row of a prefill chunk, and whatever else shares
 * the batch. Tensors (q, caches, out) are bf16 or fp32, all of one dtype:
 *   q, out: [num_tokens, num_heads, head_dim]
 *   caches: [num_blocks, block_size, num_kv_heads, head_dim]
 */
#include "cpu_vec.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_CHUNKS 8 /* head_dim <= 128: 8 vectors of 16 fp32 */
#define MAX_GROUP 8  /* query heads per kv head */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens, *cu_seqlens_q;
    void *out;
    long num_seqs, max_blocks, block_size, num_heads, num_kv_heads, head_dim;
    float scale;
    int bf16;
} Attention;

static inline const void *at(const Attention *a, const void *base, long offset) {
    return a->bf16 ? (const void *)((const uint16_t *)base + offset)
                   : (const void *)((const float *)base + offset);
}

/* The queries of one token's heads that share kv_head, over that request's keys 0..pos: each
 * key is loaded once for the whole group. scores: [group, longest + 16] scratch. */
static void attend(const Attention *a, long token, long seq, long kv_head, float *scores,
                   long width) {
    long d = a->head_dim, chunks = (d + 15) / 16, group = a->num_heads / a->num_kv_heads;
    long q_len = a->cu_seqlens_q[seq + 1] - a->cu_seqlens_q[seq];
    long pos = a->seq_lens[seq] - q_len + (token - a->cu_seqlens_q[seq]);
    const int32_t *table = a->block_tables + seq * a->max_blocks;
    long head0 = kv_head * group, row_stride = a->num_kv_heads * d;
    __m512 q[MAX_GROUP][MAX_CHUNKS];
    float max_score[MAX_GROUP];
    for (long g = 0; g < group; g++) {
        const void *q_row = at(a, a->q, (token * a->num_heads + head0 + g) * d);
        for (long c = 0; c < chunks; c++) q[g][c] = load16(q_row, c * 16, d, a->bf16);
        max_score[g] = -INFINITY;
    }
    for (long j0 = 0; j0 <= pos; j0 += a->block_size) {
        long slot0 = (long)table[j0 / a->block_size] * a->block_size;
        long n = pos + 1 - j0 < a->block_size ? pos + 1 - j0 : a->block_size;
        for (long j = 0; j < n; j++) {
            const void *k_row = at(a, a->k_cache, (slot0 + j) * row_stride + kv_head * d);
            __m512 k[MAX_CHUNKS];
            for (long c = 0; c < chunks; c++) k[c] = load16(k_row, c * 16, d, a->bf16);
            for (long g = 0; g < group; g++) {
                __m512 dot = _mm512_setzero_ps();
                for (long c = 0; c < chunks; c++) dot = _mm512_fmadd_ps(q[g][c], k[c], dot);
                float score = _mm512_reduce_add_ps(dot) * a->scale;
                scores[g * width + j0 + j] = score;
                max_score[g] = score > max_score[g] ? score : max_score[g];
            }
        }
    }
    float inv_sum[MAX_GROUP];
    for (long g = 0; g < group; g++) {
        float *sg = scores + g * width;
        __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(max_score[g]);
        for (long j = 0; j <= pos; j += 16) {
            __mmask16 m = tail_mask(pos + 1 - j);
            __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), top));
            p = _mm512_maskz_mov_ps(m, p);
            _mm512_mask_storeu_ps(sg + j, m, p);
            sum = _mm512_add_ps(sum, p);
        }
        inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 acc[MAX_GROUP][MAX_CHUNKS];
    for (long g = 0; g < group; g++)
        for (long c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    for (long j0 = 0; j0 <= pos; j0 += a->block_size) {
        long slot0 = (long)table[j0 / a->block_size] * a->block_size;
        long n = pos + 1 - j0 < a->block_size ? pos + 1 - j0 : a->block_size;
        for (long j = 0; j < n; j++) {
            const void *v_row = at(a, a->v_cache, (slot0 + j) * row_stride + kv_head * d);
            __m512 v[MAX_CHUNKS];
            for (long c = 0; c < chunks; c++) v[c] = load16(v_row, c * 16, d, a->bf16);
            for (long g = 0; g < group; g++) {
                __m512 p = _mm512_set1_ps(scores[g * width + j0 + j]);
                for (long c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
            }
        }
    }
    for (long g = 0; g < group; g++) {
        __m512 inv = _mm512_set1_ps(inv_sum[g]);
        long q_off = (token * a->num_heads + head0 + g) * d;
        void *out_row = (void *)at(a, a->out, q_off);
        for (long c = 0; c < chunks; c++)
            store16(out_row, c * 16, d, _mm512_mul_ps(acc[g][c], inv), a->bf16);
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
    long num_tokens = cu_seqlens_q[num_seqs], longest = 0;
    long *seq_of = malloc(sizeof(long) * (num_tokens ? num_tokens : 1));
    if (!seq_of) return -2;
    for (long s = 0; s < num_seqs; s++) {
        for (long t = cu_seqlens_q[s]; t < cu_seqlens_q[s + 1]; t++) seq_of[t] = s;
        longest = seq_lens[s] > longest ? seq_lens[s] : longest;
    }
    long width = longest + 16, group = num_heads / num_kv_heads;
    float *scores = malloc(sizeof(float) * width * group * omp_get_max_threads());
    if (!scores) {
        free(seq_of);
        return -2;
    }
#pragma omp parallel for schedule(static)
    for (long item = 0; item < num_tokens * num_kv_heads; item++)
        attend(&a, item / num_kv_heads, seq_of[item / num_kv_heads], item % num_kv_heads,
               scores + width * group * omp_get_thread_num(), width);
    free(scores);
    free(seq_of);
    return 0;
}
