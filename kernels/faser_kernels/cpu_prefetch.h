/* A software prefetch ahead of a weight stream, shared by the linear kernels that read their
 * weights with vector loads: the hardware prefetchers start over at every 4 KiB page and ramp up
 * too slowly for a small weight read from memory (a draft's layers right after the target's
 * forward has flushed the caches), and a prefetch changes no bit. */
#ifndef FASER_CPU_PREFETCH_H
#define FASER_CPU_PREFETCH_H

#include <immintrin.h>

#define PREFETCH_AHEAD 4096

/* The `bytes` of a stream that come PREFETCH_AHEAD after p. The AVX2 builds do without: on the
 * AVX2 CPU measured, the hardware prefetchers kept up with both the target's and the draft's
 * streams, and the prefetches only took load slots (kernels/README.md). */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *p, long bytes) {
#ifdef __AVX512F__
    for (long line = 0; line < bytes; line += 64)
        _mm_prefetch((const char *)p + PREFETCH_AHEAD + line, _MM_HINT_T0);
#else
    (void)p;
    (void)bytes;
#endif
}

#endif
