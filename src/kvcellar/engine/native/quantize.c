/* Activations to 8 bits per block of 32 inputs, the input of every linear kernel. */
#include "kvc.h"

/* xq int8 [rows, cols] (blocks reordered as above), xd / xs float [rows, cols / 32]: each
 * block's scale and scale * sum(q) (what an offset multiplies). */
void kvc_quantize_q8(const float *x, int64_t rows, int64_t cols, int8_t *xq, float *xd, float *xs,
                     int threads) {
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols > 65536)
    for (int64_t i = 0; i < rows * blocks; i++) quantize_block(x + i * BLOCK, xq + i * BLOCK, xd + i, xs + i);
}
