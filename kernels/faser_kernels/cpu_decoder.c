/* A run of Llama decoder layers in one call, on x86 CPUs with AVX-512 (or, float32 only, AVX2:
 * built with cpu_build's AVX2 flags, it takes the AVX2 builds): the same kernels as the
 * layer-by-layer path (cpu_linear.c, cpu_ops.c, cpu_attention.c) in the same order, so the same
 * bits, without a round trip through Python and torch's dispatch for each of a layer's dozen
 * operations (at one token they cost as much as the weights take to stream).
 *
 * Per layer: h = x + residual; normed = RMSNorm(h); qkv = normed Wqkv; rotary on q and k in
 * place; k, v stored in their paged slots; attention; x = attn Wo; h += x; normed = RMSNorm(h);
 * x = (silu(gate) * up)(normed Wgate_up) Wdown. After the layers named as taps, the stream's
 * state RMS-scaled (RMSNorm with a unit weight) into a feature buffer each, for a feature draft;
 * after the last, the final norm. A feature draft's input may be built in the same call (the
 * prologue): x = [embed[ids], fuse(features)] Wfc, fuse skipped for features of hidden width (the
 * draft's own guesses). The caller holds every buffer. */
#ifdef __AVX512F__
#include "cpu_attention.c"
#include "cpu_linear.c"
#include "cpu_ops.c"
#else
#include "cpu_attention_avx2.c"
#include "cpu_linear_avx2.c"
#include "cpu_ops_avx2.c"
#endif

#include <string.h>

typedef struct {
    /* per layer, num_layers entries each */
    const void *const *input_norm, *const *qkv, *const *qkv_bias, *const *o, *const *post_norm,
        *const *gate_up, *const *down;
    /* per layer, each linear's scale [out] for int8 weights, or NULL entries for the dtype's */
    const float *const *qkv_scale, *const *o_scale, *const *gate_up_scale, *const *down_scale;
    void *const *k_cache, *const *v_cache;
    /* the forward's tokens and where their keys go */
    const int64_t *positions, *slot_mapping;
    const int32_t *block_tables, *seq_lens, *cu_seqlens_q;
    const float *cos_table, *sin_table;
    long num_tokens, num_seqs, max_blocks, block_size;
    long hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    int bf16;
    /* [num_layers][4]: the format of qkv, o, gate_up and down: 0 the dtype's panels, else GGUF's
     * blocks (cpu_linear_blocks.c's codes; in bf16, of the weight before its rounding) */
    const int32_t *blocks;
    /* buffers: x [n, hidden] (in: the last layer's output; out: this run's), residual [n, hidden]
     * float32 (in and out; has_residual 0 at the first layer), and scratch */
    void *x, *normed, *qkv_out, *q, *attn, *gate_up_out, *act;
    float *residual;
    int has_residual;
    /* taps [num_taps], ascending: after layer taps[i] - 1, RMSNorm(h) with the unit weight and
     * tap_eps into tap_out[i] [n, hidden] (the model's dtype) */
    const long *taps;
    long num_taps;
    void *const *tap_out;
    const void *unit;
    float tap_eps;
    /* after the last layer, RMSNorm(h) * final_norm into final_out [n, hidden] float32 */
    const void *final_norm;
    float *final_out;
    float *summed; /* scratch [n, hidden] float32: h, which the stream does not keep */
    /* the prologue, when ids is not NULL: embed [vocab, hidden] rows by ids [n], features
     * [n, feature_dim], fuse [hidden, feature_dim] (NULL when feature_dim is hidden), fc
     * [hidden, 2 hidden], packed; into scratch joined [n, 2 hidden], then x */
    const int64_t *ids;
    const void *embed, *features, *fuse, *fc;
    const float *fuse_scale, *fc_scale;
    int fuse_blocks, fc_blocks; /* as `blocks` */
    long feature_dim;
    void *joined;
} Layers;

static void linear(const Layers *a, const void *x, const void *w, const float *scale,
                   const void *bias, void *out, long n, long k, int blocks) {
    if (blocks && !a->bf16) {
        faser_linear_blocks(x, w, bias, out, a->num_tokens, n, k, blocks);
        return;
    }
#ifdef __AVX512F__
    if (blocks)
        faser_linear_blocks_bf16(x, w, bias, out, a->num_tokens, n, k, blocks);
    else if (scale)
        faser_linear_i8(x, w, scale, bias, out, a->num_tokens, n, k);
    else if (a->bf16)
        faser_linear_bf16(x, w, bias, out, a->num_tokens, n, k);
    else
#endif
        faser_linear_f32(x, w, bias, out, a->num_tokens, n, k);
}

/* k and v rows of qkv [n, q + 2 kv] into their slots of [blocks * block_size, kv_heads, d] */
static void store_kv(const Layers *a, long layer) {
    long kv = a->num_kv_heads * a->head_dim, q = a->num_heads * a->head_dim, width = q + 2 * kv;
    size_t elem = a->bf16 ? 2 : 4;
    for (long t = 0; t < a->num_tokens; t++) {
        const char *row = (const char *)a->qkv_out + t * width * elem;
        long slot = a->slot_mapping[t];
        memcpy((char *)a->k_cache[layer] + slot * kv * elem, row + q * elem, kv * elem);
        memcpy((char *)a->v_cache[layer] + slot * kv * elem, row + (q + kv) * elem, kv * elem);
    }
}

static void copy_queries(const Layers *a) {
    long q = a->num_heads * a->head_dim, width = q + 2 * a->num_kv_heads * a->head_dim;
    size_t elem = a->bf16 ? 2 : 4;
    for (long t = 0; t < a->num_tokens; t++)
        memcpy((char *)a->q + t * q * elem, (const char *)a->qkv_out + t * width * elem, q * elem);
}

static int layer(Layers *a, long l) {
    long n = a->num_tokens, d = a->hidden, q = a->num_heads * a->head_dim;
    long width = q + 2 * a->num_kv_heads * a->head_dim;
    faser_add_rms_norm(a->x, a->has_residual ? a->residual : NULL, a->input_norm[l], a->normed,
                       a->residual, n, d, a->eps, a->bf16, a->bf16);
    a->has_residual = 1;
    linear(a, a->normed, a->qkv[l], a->qkv_scale[l], a->qkv_bias[l], a->qkv_out, width, d,
           a->blocks[4 * l]);
    faser_rotary(a->qkv_out, a->positions, a->cos_table, a->sin_table, n,
                 a->num_heads + a->num_kv_heads, a->head_dim, width, a->bf16);
    store_kv(a, l);
    copy_queries(a);
    int code = faser_paged_attention(a->q, a->k_cache[l], a->v_cache[l], a->block_tables,
                                     a->seq_lens, a->cu_seqlens_q, a->attn, a->num_seqs,
                                     a->max_blocks, a->block_size, a->num_heads,
                                     a->num_kv_heads, a->head_dim, a->scale, a->bf16);
    if (code) return code;
    linear(a, a->attn, a->o[l], a->o_scale[l], NULL, a->x, d, q, a->blocks[4 * l + 1]);
    faser_add_rms_norm(a->x, a->residual, a->post_norm[l], a->normed, a->residual, n, d, a->eps,
                       a->bf16, a->bf16);
    linear(a, a->normed, a->gate_up[l], a->gate_up_scale[l], NULL, a->gate_up_out,
           2 * a->intermediate, d, a->blocks[4 * l + 2]);
    faser_silu_mul(a->gate_up_out, a->act, n, a->intermediate, a->bf16);
    linear(a, a->act, a->down[l], a->down_scale[l], NULL, a->x, d, a->intermediate,
           a->blocks[4 * l + 3]);
    return 0;
}

/* x = [embed[ids], fuse(features)] Wfc: a token's embedding beside its feature row, each row in
 * its half of `joined` (the fused features written there straight from the kernel). */
static void prologue(const Layers *a) {
    long n = a->num_tokens, d = a->hidden;
    size_t elem = a->bf16 ? 2 : 4, row = 2 * d * elem;
    char *joined = a->joined;
    for (long t = 0; t < n; t++)
        memcpy(joined + t * row, (const char *)a->embed + a->ids[t] * d * elem, d * elem);
    if (a->fuse) {
        char *fused = joined + n * row; /* scratch past the joined rows */
        linear(a, a->features, a->fuse, a->fuse_scale, NULL, fused, d, a->feature_dim,
               a->fuse_blocks);
        for (long t = 0; t < n; t++)
            memcpy(joined + t * row + d * elem, fused + t * d * elem, d * elem);
    } else {
        for (long t = 0; t < n; t++)
            memcpy(joined + t * row + d * elem, (const char *)a->features + t * d * elem,
                   d * elem);
    }
    linear(a, joined, a->fc, a->fc_scale, NULL, a->x, d, 2 * d, a->fc_blocks);
}

/* The prologue if any, layers [0, num_layers) with their taps and the final norm; 0, or the
 * attention kernel's error code. */
int faser_decoder_layers(Layers *a, long num_layers) {
    long n = a->num_tokens, d = a->hidden, t = 0;
    if (a->ids) prologue(a);
    for (long l = 0; l < num_layers; l++) {
        int code = layer(a, l);
        if (code) return code;
        for (; t < a->num_taps && a->taps[t] == l + 1; t++)
            faser_add_rms_norm(a->x, a->residual, a->unit, a->tap_out[t], a->summed, n, d,
                               a->tap_eps, a->bf16, a->bf16);
    }
    faser_add_rms_norm(a->x, a->residual, a->final_norm, a->final_out, a->summed, n, d, a->eps,
                       a->bf16, 0);
    return 0;
}
