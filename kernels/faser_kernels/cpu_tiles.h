/* The query tiles of a paged-attention call, for cpu_attention.c and its AVX2 build: each
 * request's queries in tiles of `tile`. */
#ifndef FASER_CPU_TILES_H
#define FASER_CPU_TILES_H

#include <stdint.h>
#include <stdlib.h>

/* (request, first query) per tile, 2 longs each, malloc'd (NULL when out of memory); their
 * count and the longest context into *num_tiles and *longest. */
static long *query_tiles(const int32_t *cu_seqlens_q, const int32_t *seq_lens, long num_seqs,
                         long tile, long *num_tiles, long *longest) {
    long count = 0, most = 0;
    for (long s = 0; s < num_seqs; s++) {
        count += (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + tile - 1) / tile;
        most = seq_lens[s] > most ? seq_lens[s] : most;
    }
    long *tiles = malloc(sizeof(long) * 2 * (count ? count : 1));
    if (tiles)
        for (long s = 0, i = 0; s < num_seqs; s++)
            for (long t = cu_seqlens_q[s]; t < cu_seqlens_q[s + 1]; t += tile, i++)
                tiles[2 * i] = s, tiles[2 * i + 1] = t;
    *num_tiles = count, *longest = most;
    return tiles;
}

#endif
