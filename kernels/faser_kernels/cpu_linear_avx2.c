/* Row-invariant float32 linear layers for x86 CPUs with AVX2 and FMA but no AVX-512:
 * out[m, n] = x[m, :] . w[n, :] + b[n], exported as cpu_linear.c's faser_linear_f32.
 *
 * The same contract and weight layout as cpu_linear.c's float32 path ([num_panels, K, PANEL],
 * packed by cpu_linear.pack_weight): every output element is one fp32 accumulator that walks k
 * in order, whatever the number of rows, the row's place in the batch or the thread, so row m of
 * an M-row call has the bits of a one-row call. The walk is cpu_linear_blocks.c's, over the
 * panel itself instead of a dequantized buffer: three rows of a panel's four 8-wide vectors
 * (twelve accumulators) and a broadcast fit AVX2's sixteen registers, the panel's vectors read
 * as the FMAs' memory operands; rows past three take the panel again, from the cache it was just
 * read into.
 */
#define PANEL 32

#include "cpu_linear_blocks.c"

void faser_linear_f32(const float *x, const float *w, const float *bias, float *out, long m,
                      long n, long k) {
    faser_linear_blocks(x, (const uint8_t *)w, bias, out, m, n, k, PANELS_F32);
}

int faser_linear_uses_amx(void) { return 0; }
