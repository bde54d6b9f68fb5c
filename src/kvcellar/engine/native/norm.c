/* RMSNorm of the hidden states, a layer's two and the model's last: one call where torch took
 * ~10 operations (a decode step's norms cost more in dispatch than in arithmetic). Each row by
 * the same operations whatever the step's rows, so a token's numbers do not depend on its step. */
#include "kvc.h"

typedef struct {
    const void *x; const float *weight; int64_t cols; float eps; int bf16, weight_first; void *out;
} norm_call;

/* Rows r0..r1-1: h = x / sqrt(mean(x^2) + eps) in float32 (the squares summed in 4 x 8 lanes,
 * then across them), then weight x round(h) rounded (transformers' Llama/Qwen order), or
 * weight x h rounded where weight_first (gpt-oss's); rounded to bf16 where bf16. */
static void norm_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    (void)thread;
    const norm_call *c = ctx;
    const int64_t cols = c->cols;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xb = (const uint16_t *)c->x + r * cols;
        const float *xf = (const float *)c->x + r * cols;
#define LOAD8(i) (c->bf16 ? load8_bf16(xb + (i)) : _mm256_loadu_ps(xf + (i)))
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t i = 0;
        for (; i + 32 <= cols; i += 32)
            for (int k = 0; k < 4; k++) {
                const __m256 v = LOAD8(i + 8 * k);
                acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
            }
        for (; i < cols; i += 8) {
            const __m256 v = LOAD8(i);
            acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
        }
        const float inv = 1.0f / sqrtf(hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                                         _mm256_add_ps(acc[2], acc[3]))) / (float)cols + c->eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        const dest row = dest_at((dest){c->out, c->bf16}, r * cols);
        for (i = 0; i < cols; i += 8) {
            __m256 h = _mm256_mul_ps(LOAD8(i), vinv);
            if (c->bf16 && !c->weight_first) h = round_bf16(h);
            put8(row, i, _mm256_mul_ps(_mm256_loadu_ps(c->weight + i), h));
        }
#undef LOAD8
    }
}

/* x [rows, cols] float32, or bfloat16 where bf16, into out (the same shape and dtype); cols a
 * multiple of 8; weight float32 [cols] (a bf16 weight's values exactly). */
void kvc_rms_norm(const void *x, int bf16, const float *weight, int64_t rows, int64_t cols, float eps,
                  int weight_first, void *out, int threads) {
    norm_call c = {x, weight, cols, eps, bf16, weight_first, out};
    pool_for(rows * cols > 65536 ? threads : 1, rows, 1, norm_rows, &c);
}
