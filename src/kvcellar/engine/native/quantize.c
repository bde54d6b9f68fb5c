/* Activations to 8 bits per block of 32 inputs, the input of every linear kernel. */
#include "kvc.h"

/* xq int8 [rows, cols] (blocks reordered as above), xd / xs float [rows, cols / 32]: each
 * block's scale and scale * sum(q) (what an offset multiplies). x: float32, or bfloat16 where
 * x_bf16 (each block widened to float32 first: the numbers of its float32 copy). */
typedef struct { const void *x; int x_bf16; int8_t *xq; float *xd, *xs; } quantize_call;

static void quantize_blocks(void *ctx, int64_t i0, int64_t i1, int thread) {
    (void)thread;
    const quantize_call *c = ctx;
    for (int64_t i = i0; i < i1; i++) {
        if (!c->x_bf16) {
            quantize_block((const float *)c->x + i * BLOCK, c->xq + i * BLOCK, c->xd + i, c->xs + i);
            continue;
        }
        float wide[BLOCK];
        const uint16_t *src = (const uint16_t *)c->x + i * BLOCK;
        for (int k = 0; k < BLOCK; k += 8) _mm256_storeu_ps(wide + k, load8_bf16(src + k));
        quantize_block(wide, c->xq + i * BLOCK, c->xd + i, c->xs + i);
    }
}

void kvc_quantize_q8(const void *x, int x_bf16, int64_t rows, int64_t cols, int8_t *xq, float *xd, float *xs,
                     int threads) {
    const int64_t n = rows * (cols / BLOCK);
    quantize_call c = {x, x_bf16, xq, xd, xs};
    /* below ~2k blocks a second thread costs more than it saves */
    pool_for(rows * cols > 65536 ? threads : 1, n, n / (8 * (threads > 0 ? threads : 1)) + 1, quantize_blocks, &c);
}
