#include "kvc.h"

/* ---- MXFP4 (OCP microscaling FP4, gpt-oss's experts) ----------------------------------
 * Layout: nibbles uint8 [out, in / 2] as int4's (input 2j low, 2j + 1 high), each an E2M1 code,
 * and per block of 32 inputs one E8M0 exponent byte e: w = value(code) * 2^(e - 127). The
 * values doubled are integers (0, 1, 2, 3, 4, 6, 8, 12 and their negatives), so a block's dot
 * product with the 8-bit activations is exact in integers, and the block scale (halved) a
 * power of two. One kernel for every row count: each activation row's sums are its own. */

/* 2^(e - 128), the block scale of the doubled values (e < 2: a subnormal float). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Output r of MXFP4 weights (row wr, its exponents er) against n <= TILE activation rows:
 * codes to signed values by a table lookup, signs moved onto the activations as q8_row does;
 * each lane sums 4 inputs' products of every block, scaled per block, summed across lanes
 * at the end. */
static inline void mx_row(const uint8_t *wr, const uint8_t *er, int64_t r, int64_t out, int64_t blocks,
                          const int8_t *xq, const float *xd, int n, float *y) {
    const __m256i values = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE];
    for (int a = 0; a < n; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        _mm_prefetch((const char *)(wr + b * (BLOCK / 2) + PREFETCH), _MM_HINT_T0);
        const __m256i wq = _mm256_shuffle_epi8(values, _mm256_castps_si256(q4_block(wr + b * (BLOCK / 2))));
        const __m256i wabs = _mm256_sign_epi8(wq, wq);
        const float d = e8m0_half(er[b]);
        for (int a = 0; a < n; a++) {
            const int64_t i = a * blocks + b;
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + i * BLOCK)), wq);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones);
            acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[i]), acc[a]);
        }
    }
    for (int a = 0; a < n; a++) y[a * out + r] = hsum(acc[a]);
}

/* Bytes ahead a decode pass over MXFP4 rows asks the cache for: with 4 rows' streams at once
 * (mx_rows), 2048 left a thread's reads short of the memory's speed (docs/performance.md). */
#define MX_PREFETCH 4096
#define MX_ROWS 4

/* Outputs r..r+R-1 (R <= MX_ROWS) of MXFP4 weights (w, exps: the whole matrix) against one
 * activation row, side by side: its loads shared, R streams of weights in flight. Each
 * output gets mx_row's operations in mx_row's order: the same bits. */
static inline void mx_rows(const uint8_t *w, const uint8_t *exps, int64_t r, int R, int64_t blocks,
                           const int8_t *xq, const float *xd, float *y) {
    const __m256i values = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t stride = blocks * (BLOCK / 2);
    __m256 acc[MX_ROWS];
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
        for (int j = 0; j < R; j++) {
            const uint8_t *wb = w + (r + j) * stride + b * (BLOCK / 2);
            _mm_prefetch((const char *)(wb + MX_PREFETCH), _MM_HINT_T0);
            const __m256i wq = _mm256_shuffle_epi8(values, _mm256_castps_si256(q4_block(wb)));
            const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
            const float d = e8m0_half(exps[(r + j) * blocks + b]);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones)), _mm256_set1_ps(d * xd[b]),
                                     acc[j]);
        }
    }
    for (int j = 0; j < R; j++) y[r + j] = hsum(acc[j]);
}

/* y [rows, out] float32 = x @ w.T for MXFP4 weights; a single row (decode) MX_ROWS outputs at a time. */
void kvc_gemm_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t out, int64_t cols, const int8_t *xq,
                    const float *xd, int64_t rows, float *y, int threads) {
    const int64_t blocks = cols / BLOCK;
    if (rows == 1) {
        #pragma omp parallel for schedule(dynamic, 8 * ROW_GROUPS / MX_ROWS) num_threads(threads)
        for (int64_t r = 0; r < out; r += MX_ROWS)
            mx_rows(w, exps, r, out - r < MX_ROWS ? (int)(out - r) : MX_ROWS, blocks, xq, xd, y);
        return;
    }
    #pragma omp parallel for schedule(dynamic, 8 * ROW_GROUPS) num_threads(threads)
    for (int64_t r = 0; r < out; r++)
        for (int64_t a0 = 0; a0 < rows; a0 += TILE)
            mx_row(w + r * (cols / 2), exps + r * blocks, r, out, blocks, xq + a0 * cols, xd + a0 * blocks,
                   rows - a0 < TILE ? (int)(rows - a0) : TILE, y + a0 * out);
}

/* Rows start..end-1 of an MXFP4 weight as float32 [end - start, cols]. */
void kvc_dequantize_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t start, int64_t end, int64_t cols,
                          float *out, int threads) {
    static const float values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = start; r < end; r++) {
        float *o = out + (r - start) * cols;
        for (int64_t b = 0; b < blocks; b++) {
            const float d = e8m0_half(exps[r * blocks + b]);
            const uint8_t *q = w + r * (cols / 2) + b * (BLOCK / 2);
            for (int k = 0; k < BLOCK / 2; k++) {
                o[b * BLOCK + 2 * k] = values[q[k] & 0x0F] * d;
                o[b * BLOCK + 2 * k + 1] = values[q[k] >> 4] * d;
            }
        }
    }
}

int kvc_moe_mxfp4(const int64_t *w, const int64_t *exps, const int64_t *starts, int64_t experts, int64_t out,
                  int64_t cols, const int8_t *xq, const float *xd, float *y, int threads) {
    const int64_t blocks = cols / BLOCK, groups = (out + 7) / 8;
    int64_t count;
    moe_unit *units = moe_units(starts, experts, groups, &count);
    if (!units) return -1;
    const int chunk = moe_chunk(starts, experts);
    #pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
    for (int64_t u = 0; u < count; u++) {
        const int64_t e = units[u].e, a0 = starts[e], a1 = starts[e + 1];
        const uint8_t *we = (const uint8_t *)w[e], *ee = (const uint8_t *)exps[e];
        const int64_t r1 = units[u].g * 8 + 8 < out ? units[u].g * 8 + 8 : out;
        if (a1 - a0 == 1) {  /* an expert one token of the step chose: its rows side by side */
            for (int64_t r = units[u].g * 8; r < r1; r += MX_ROWS)
                mx_rows(we, ee, r, r1 - r < MX_ROWS ? (int)(r1 - r) : MX_ROWS, blocks, xq + a0 * cols, xd + a0 * blocks,
                        y + a0 * out);
            continue;
        }
        for (int64_t r = units[u].g * 8; r < r1; r++)
            for (int64_t a = a0; a < a1; a += TILE)
                mx_row(we + r * (cols / 2), ee + r * blocks, r, out, blocks, xq + a * cols, xd + a * blocks,
                       a1 - a < TILE ? (int)(a1 - a) : TILE, y + a * out);
    }
    free(units);
    return 0;
}
