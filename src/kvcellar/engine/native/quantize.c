/* Activations to 8 bits per block of 32 inputs, the input of every linear kernel. */
#include "kvc.h"

/* xq int8 [rows, cols] (blocks reordered as above), xd / xs float [rows, cols / 32]: each
 * block's scale and scale * sum(q) (what an offset multiplies). */
void kvc_quantize_q8(const float *x, int64_t rows, int64_t cols, int8_t *xq, float *xd, float *xs,
                     int threads) {
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols > 65536)
    for (int64_t i = 0; i < rows * blocks; i++) {
        const float *v = x + i * BLOCK;
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int k = 0; k < BLOCK; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *q = xq + i * BLOCK;
        int sum = 0;
        for (int k = 0; k < BLOCK / 2; k++) {
            const int even = (int)nearbyintf(v[2 * k] * id), odd = (int)nearbyintf(v[2 * k + 1] * id);
            q[k] = (int8_t)even;
            q[BLOCK / 2 + k] = (int8_t)odd;
            sum += even + odd;
        }
        xd[i] = d;
        xs[i] = d * (float)sum;
    }
}
