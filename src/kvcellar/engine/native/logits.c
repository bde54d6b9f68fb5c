/* A step's logits on their way to the sampler, on the calling thread: a few hundred microseconds
 * of torch operations a step otherwise (a conversion each way for a bf16 model's head, an argmax
 * that is not vectorized), each waking torch's sleeping threads for a vocabulary's worth of work. */
#include "kvc.h"

/* x[0..n-1] rounded in place to bfloat16's precision, as torch rounds a float32 to a bf16 and
 * back: nearest even, NaN as 0x7FC00000. */
void kvc_round_bf16(float *x, int64_t n) {
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(x + i, _mm256_blendv_ps(round_bf16(v), nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    for (; i < n; i++) {
        const __m256 v = _mm256_set1_ps(x[i]);
        x[i] = x[i] != x[i] ? _mm256_cvtss_f32(nan) : _mm256_cvtss_f32(round_bf16(v));
    }
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The first NaN of row[0..cols-1]; cols where there is none. */
static int64_t first_nan(const float *row, int64_t cols) {
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
    for (; i < cols && row[i] == row[i]; i++) {}
    return i;
}

/* out[r]: the first index of row r's greatest value (x [rows, cols]), as torch.argmax gives it:
 * a NaN counts as the greatest (the first NaN's index). Two passes that chain no comparison to
 * the one before: the greatest value (four running maxima), then where it first occurs. */
void kvc_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        __m256 m[4], unordered = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) m[k] = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 32 <= cols; i += 32)
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_loadu_ps(row + i + 8 * k);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                m[k] = _mm256_max_ps(m[k], v);
            }
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m[0] = _mm256_max_ps(m[0], v);
        }
        float top = hmax8(_mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
        int nan = _mm256_movemask_ps(unordered) != 0;
        for (; i < cols; i++) {
            nan |= row[i] != row[i];
            top = row[i] > top ? row[i] : top;
        }
        if (nan) {
            out[r] = first_nan(row, cols);
            continue;
        }
        const __m256 vt = _mm256_set1_ps(top);
        for (i = 0; i + 8 <= cols; i += 8) {
            const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), vt, _CMP_EQ_OQ));
            if (mask) break;
        }
        for (; i < cols && row[i] != top; i++) {}  /* within the vector that holds it, or the tail */
        out[r] = i < cols ? i : 0;  /* a row of -inf only: its first */
    }
}

/* Sift entry i of a min-heap of n values down (its least at 0; of equal values, the later index
 * is the lesser: it goes first). */
static void sift_down(float *v, int64_t *id, int64_t n, int64_t i) {
    for (;;) {
        int64_t least = i;
        for (int64_t c = 2 * i + 1; c <= 2 * i + 2 && c < n; c++)
            if (v[c] < v[least] || (v[c] == v[least] && id[c] > id[least])) least = c;
        if (least == i) return;
        const float tv = v[i]; v[i] = v[least]; v[least] = tv;
        const int64_t ti = id[i]; id[i] = id[least]; id[least] = ti;
        i = least;
    }
}

/* The k greatest of x[0..n-1] (1 <= k <= n), greatest first (equal values: the lower index first),
 * into values and ids: one pass that skips 8 values at a time while none beats the heap's least,
 * which is all of them but a few hundred in a vocabulary. Returns 0; -1 at a NaN (torch.topk's
 * order for it is the caller's). */
int kvc_topk_row(const float *x, int64_t n, int64_t k, float *values, int64_t *ids) {
    for (int64_t i = 0; i < k; i++) {
        if (x[i] != x[i]) return -1;
        values[i] = x[i];
        ids[i] = i;
    }
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(values, ids, k, i);
    for (int64_t i = k; i < n; ) {
        /* not (x <= least), unordered included: a NaN stops the skip too */
        if (i + 8 <= n && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(values[0]),
                                                             _CMP_NLE_UQ))) {
            i += 8;
            continue;
        }
        for (const int64_t end = i + 8 <= n ? i + 8 : n; i < end; i++) {
            if (x[i] != x[i]) return -1;
            if (x[i] > values[0]) {  /* a later equal value never displaces an earlier one */
                values[0] = x[i];
                ids[0] = i;
                sift_down(values, ids, k, 0);
            }
        }
    }
    for (int64_t m = k; m > 1; m--) {  /* heap sort: the least to the end, so greatest first */
        const float tv = values[0]; values[0] = values[m - 1]; values[m - 1] = tv;
        const int64_t ti = ids[0]; ids[0] = ids[m - 1]; ids[m - 1] = ti;
        sift_down(values, ids, m - 1, 0);
    }
    return 0;
}
