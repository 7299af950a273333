/* AMX, where the CPU has it and Linux grants it: whether this process may use the tiles, and the
 * one tile configuration every kernel here uses (eight tiles of 16 rows x 64 bytes). */
#ifndef FASER_CPU_AMX_H
#define FASER_CPU_AMX_H

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>

#define TILE_ROWS 16
#define TILE_K 32 /* bf16 per tile row: 64 bytes */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

long syscall(long number, ...);

/* Whether this process may use AMX: the CPU has it and Linux grants the tile state. */
static int amx_enabled(void) {
    static int enabled = -1;
    if (enabled < 0) {
        unsigned int eax, ebx, ecx, edx;
        int has = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 22 & 1) &&
                  (edx >> 24 & 1);
        enabled = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return enabled;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tmm0-7, each 16 rows x 64 bytes, for the calling thread. */
__attribute__((target("amx-tile"))) static void configure_tiles(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = TILE_ROWS;
    }
    /* not _tile_loadconfig: GCC's tells the compiler that it reads 8 bytes, and the stores of
     * the rows and widths may then be dropped */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

__attribute__((target("amx-tile"))) static void release_tiles(void) { _tile_release(); }

#endif
