/* The gated delta rule (Gated DeltaNet, engine/deltanet.py), a token at a time, each value head
 * on one thread with its state in cache for all of a step's rows:
 *
 *   S = S * decay;  delta = (v - S^T k) * beta;  S = S + k delta^T;  o = S^T q
 *
 * S [key_dim, value_dim] per head. Every sum runs over the key dimension in ascending order
 * with fused multiply-adds, eight value columns to a vector: a row's numbers depend only on its
 * own inputs and the state it continues, never on the other rows of the step. */
#include "kvc.h"

#define COLS 32 /* value columns a pass over the key dimension carries: four vectors */

/* One row of one head: S updated in place, o [value_dim] written. */
static void delta_row(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                      int64_t key_dim, int64_t value_dim, float *o) {
    const __m256 d = _mm256_set1_ps(decay);
    const __m256 b = _mm256_set1_ps(beta);
    for (int64_t c = 0; c < value_dim; c += COLS) {
        const int64_t width = value_dim - c < COLS ? value_dim - c : COLS; /* a multiple of 8 */
        const int64_t vecs = width / 8;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < key_dim; i++) {
            float *row = S + i * value_dim + c;
            const __m256 ki = _mm256_set1_ps(k[i]);
            for (int64_t u = 0; u < vecs; u++) {
                const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * u), d);
                _mm256_storeu_ps(row + 8 * u, s);
                acc[u] = _mm256_fmadd_ps(s, ki, acc[u]);
            }
        }
        __m256 delta[4];
        for (int64_t u = 0; u < vecs; u++) {
            delta[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + c + 8 * u), acc[u]), b);
            acc[u] = _mm256_setzero_ps();
        }
        for (int64_t i = 0; i < key_dim; i++) {
            float *row = S + i * value_dim + c;
            const __m256 ki = _mm256_set1_ps(k[i]);
            const __m256 qi = _mm256_set1_ps(q[i]);
            for (int64_t u = 0; u < vecs; u++) {
                const __m256 s = _mm256_fmadd_ps(ki, delta[u], _mm256_loadu_ps(row + 8 * u));
                _mm256_storeu_ps(row + 8 * u, s);
                acc[u] = _mm256_fmadd_ps(s, qi, acc[u]);
            }
        }
        for (int64_t u = 0; u < vecs; u++)
            _mm256_storeu_ps(o + c + 8 * u, acc[u]);
    }
}

int kvc_gated_delta(const float *q, const float *k, const float *v, const float *decay, const float *beta,
                    float *states, int64_t n_slots, const int64_t *slots, const int64_t *captures, int64_t rows,
                    int64_t heads, int64_t key_dim, int64_t value_dim, float *out, int threads) {
    if (value_dim % 8 != 0 || key_dim <= 0 || heads <= 0)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= n_slots || captures[r] < -1 || captures[r] >= n_slots)
            return -2;
    const int64_t size = key_dim * value_dim;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at = r * heads + h;
            float *S = states + (slots[r] * heads + h) * size;
            delta_row(S, q + at * key_dim, k + at * key_dim, v + at * value_dim, decay[at], beta[at], key_dim,
                      value_dim, out + at * value_dim);
            if (captures[r] >= 0)
                memcpy(states + (captures[r] * heads + h) * size, S, (size_t)size * sizeof(float));
        }
    }
    return 0;
}
