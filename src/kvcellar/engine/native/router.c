/* Mixture-of-experts routers: a token's logits over the experts, the experts it takes and their
 * weights, in one call a layer (a decode step ran ~10 torch operations a layer for them). */
#include "kvc.h"

/* The dot product of float32 rows a and b in float64: 16 lanes of products (each exact in float64;
 * four chains, so that the adds' latency does not bound it) summed in input order, then the lanes
 * in a fixed order: the same for a row in any step. */
static inline double dot64(const float *a, const float *b, int64_t n) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int c = 0; c < 4; c++)
            acc[c] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + i + 4 * c)),
                                     _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4 * c)), acc[c]);
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
    double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < n; i++) sum += (double)a[i] * (double)b[i];
    return sum;
}

/* The k largest of v [n] into index (largest first; the lower index first among equals). */
static inline void top_k(const float *v, int64_t n, int64_t k, int64_t *index) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= index[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        index[j] = best;
    }
}

/* Rows of x [rows, cols] through a router of weight [experts, cols] (bias [experts] or NULL):
 * logits [rows, experts] = the float64 dot products (+ bias) rounded to float32; then, per row,
 * order 0 (Qwen MoE): a softmax over every expert, the top k probabilities, divided by their
 * sum where normalize; order 1 (gpt-oss): the top k logits and a softmax over them. index
 * [rows, k] (int64) and weights [rows, k] (float32). Each row's numbers are its own. */
int kvc_route(const float *x, const float *weight, const float *bias, int64_t rows, int64_t cols, int64_t experts,
              int64_t k, int order, int normalize, float *logits, int64_t *index, float *weights, int threads) {
    if (k <= 0 || k > experts || (order != 0 && order != 1)) return -2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * experts * cols > (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *lr = logits + r * experts;
        for (int64_t e = 0; e < experts; e++)
            lr[e] = (float)(dot64(xr, weight + e * cols, cols) + (bias ? (double)bias[e] : 0.0));
        int64_t *ir = index + r * k;
        float *wr = weights + r * k;
        if (order == 1) {
            top_k(lr, experts, k, ir);
            const float top = lr[ir[0]];
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++) sum += wr[j] = expf(lr[ir[j]] - top);
            for (int64_t j = 0; j < k; j++) wr[j] /= sum;
            continue;
        }
        float top = lr[0];
        for (int64_t e = 1; e < experts; e++) top = lr[e] > top ? lr[e] : top;
        float sum = 0.0f;
        for (int64_t e = 0; e < experts; e++) sum += expf(lr[e] - top);
        /* the probabilities' order is the logits' (one max, one sum): the top k of the logits */
        top_k(lr, experts, k, ir);
        float kept = 0.0f;
        for (int64_t j = 0; j < k; j++) kept += wr[j] = expf(lr[ir[j]] - top) / sum;
        if (normalize)
            for (int64_t j = 0; j < k; j++) wr[j] /= kept;
    }
    return 0;
}
