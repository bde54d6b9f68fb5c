/* int8 linears (a float32 scale per output row) and a MoE layer's routed int8 experts. */
#include "kvc.h"

/* Block b of an int8 weight row in the activations' order (even inputs, then odd ones). */
static inline __attribute__((always_inline)) __m256i q8_weights(const int8_t *wr, int64_t b) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(wr + b * BLOCK));
    const __m256i even_odd = _mm256_shuffle_epi8(raw, _mm256_setr_epi8(
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    /* lanes: [e0-7 o0-7 | e8-15 o8-15] -> [e0-15 | o0-15] */
    return _mm256_permute4x64_epi64(even_odd, 0xD8);
}

/* acc[a] += block b's dot product with activation row a (of n) x its scale: signs moved onto the
 * activations, as the 8-bit dot product takes one unsigned operand. */
static inline __attribute__((always_inline)) void q8_step(__m256i wq, int64_t b, int64_t blocks, const int8_t *xq,
                                                          const float *xd, int n, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1), wabs = _mm256_sign_epi8(wq, wq);
    for (int a = 0; a < n; a++) {
        const int64_t i = a * blocks + b;
        const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + i * BLOCK)), wq);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones);
        acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd[i]), acc[a]);
    }
}

/* Output r of int8 weights (row wr, its scale) against n <= TILE activation rows. */
static inline void q8_row(const int8_t *wr, float scale, int64_t r, int64_t out, int64_t blocks, const int8_t *xq,
                          const float *xd, int n, float *y) {
    __m256 acc[TILE];
    for (int a = 0; a < n; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        _mm_prefetch((const char *)(wr + b * BLOCK + PREFETCH), _MM_HINT_T0);
        q8_step(q8_weights(wr, b), b, blocks, xq, xd, n, acc);
    }
    for (int a = 0; a < n; a++) y[a * out + r] = hsum(acc[a]) * scale;
}

/* q8_row on AVX-512 with VNNI, two blocks a load: each 4 bytes' products summed by one
 * vpdpbusd to the integer maddubs and madd give, and each block's float operations in q8_row's
 * order (its 8 lanes, block after block): the same bits, in about half the instructions (an LM
 * head's int8 rows were compute-bound on two hyperthreads of one core). */
static inline AVX512 __attribute__((always_inline)) void q8_row_wide(const int8_t *wr, float scale, int64_t r,
                                                                     int64_t out, int64_t blocks, const int8_t *xq,
                                                                     const float *xd, int n, float *y) {
    const __m512i even_odd = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m512i halves = _mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7);  /* per block: [e0-15 | o0-15] */
    const __m512i zero = _mm512_setzero_si512();
    __m256 acc[TILE];
    for (int a = 0; a < n; a++) acc[a] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        _mm_prefetch((const char *)(wr + b * BLOCK + PREFETCH), _MM_HINT_T0);
        const __m512i wq = _mm512_permutexvar_epi64(halves, _mm512_shuffle_epi8(
            _mm512_loadu_si512((const void *)(wr + b * BLOCK)), even_odd));
        const __m512i wabs = _mm512_abs_epi8(wq);
        const __mmask64 negative = _mm512_movepi8_mask(wq);
        for (int a = 0; a < n; a++) {
            const int64_t i = a * blocks + b;
            const __m512i x = _mm512_loadu_si512((const void *)(xq + i * BLOCK));
            const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, zero, x);  /* w's sign on x */
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wabs, signed_x));
            acc[a] = _mm256_fmadd_ps(_mm512_castps512_ps256(p), _mm256_set1_ps(xd[i]), acc[a]);
            acc[a] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)),
                                     _mm256_set1_ps(xd[i + 1]), acc[a]);
        }
    }
    if (b < blocks) q8_step(q8_weights(wr, b), b, blocks, xq, xd, n, acc);  /* an odd last block */
    for (int a = 0; a < n; a++) y[a * out + r] = hsum(acc[a]) * scale;
}

/* Outputs r0..r1-1 of int8 weights w (scales) against activation rows a0..a1-1 into y [.., out]
 * by the row function Q8_ROW names where it is used (q8_row or q8_row_wide): whole tiles of TILE
 * rows, then the last 1-3 as constants, so the accumulators stay in registers. */
#define Q8_ROWS(n) Q8_ROW(w + r * cols, scales[r], r, out, blocks, xq + a * cols, xd + a * blocks, n, y + a * out)
#define Q8_BLOCK() do {                                                                              \
        const int64_t blocks = cols / BLOCK;                                                         \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            int64_t a = a0;                                                                          \
            for (; a + TILE <= a1; a += TILE) Q8_ROWS(TILE);                                         \
            LAST_ROWS_OF_4(a1 - a, Q8_ROWS);                                                         \
        }                                                                                            \
    } while (0)

#define Q8_ROW q8_row_wide
static AVX512 void q8_block_wide(const int8_t *w, const float *scales, int64_t r0, int64_t r1, int64_t out,
                                 int64_t cols, const int8_t *xq, const float *xd, int64_t a0, int64_t a1, float *y) {
    Q8_BLOCK();
}
#undef Q8_ROW

#define Q8_ROW q8_row
static inline void q8_block(const int8_t *w, const float *scales, int64_t r0, int64_t r1, int64_t out,
                            int64_t cols, const int8_t *xq, const float *xd, int64_t a0, int64_t a1, float *y) {
    if (avx512_cpu())
        q8_block_wide(w, scales, r0, r1, out, cols, xq, xd, a0, a1, y);
    else
        Q8_BLOCK();
}
#undef Q8_ROW
#undef Q8_BLOCK
#undef Q8_ROWS

/* Linears 0..count-1 (w[i], scales[i], outs[i] rows into ys[i]) over the same activations. */
typedef struct {
    const int64_t *w, *scales, *outs, *ys; const moe_unit *units; int64_t cols; const int8_t *xq; const float *xd;
    int64_t rows;
} q8_call;

/* Rows [r0, r1) of linear i for every activation row. */
static inline void q8_rows(const q8_call *c, int64_t i, int64_t r0, int64_t r1) {
    q8_block((const int8_t *)c->w[i], (const float *)c->scales[i], r0, r1, c->outs[i], c->cols, c->xq, c->xd, 0,
             c->rows, (float *)c->ys[i]);
}

static void gemm_q8_rows(void *ctx, int64_t r0, int64_t r1, int thread) {
    (void)thread;
    q8_rows(ctx, 0, r0, r1);
}

/* y [rows, out] float32 = x @ w.T for int8 weights. */
void kvc_gemm_q8(const int8_t *w, const float *scales, int64_t out, int64_t cols,
                 const int8_t *xq, const float *xd, int64_t rows, float *y, int threads) {
    const int64_t wa = (int64_t)w, sa = (int64_t)scales, ya = (int64_t)y;
    q8_call c = {&wa, &sa, &out, &ya, NULL, cols, xq, xd, rows};
    pool_for(threads, out, 8 * ROW_GROUPS, gemm_q8_rows, &c);
}

static void gemm_q8_many_units(void *ctx, int64_t u0, int64_t u1, int thread) {
    (void)thread;
    const q8_call *c = ctx;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t i = c->units[u].e, r0 = c->units[u].g * 8;
        q8_rows(c, i, r0, r0 + 8 < c->outs[i] ? r0 + 8 : c->outs[i]);
    }
}

/* Linears that take the same activations (a layer's q/k/v, gate/up), all in one loop
 * over activations quantized once: weight i (w[i], scales[i]) of outs[i] rows into ys[i] [rows,
 * outs[i]], each output by kvc_gemm_q8's arithmetic. A step then wakes the threads once for
 * them, not once a linear. */
int kvc_gemm_q8_many(const int64_t *w, const int64_t *scales, const int64_t *outs, const int64_t *ys, int64_t count,
                     int64_t cols, const int8_t *xq, const float *xd, int64_t rows, int threads) {
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++)
        if (outs[i] <= 0) return -2;
    moe_unit *units = linear_units(outs, count, 1, &n);
    if (!units) return -1;
    q8_call c = {w, scales, outs, ys, units, cols, xq, xd, rows};
    pool_for(threads, n, ROW_GROUPS, gemm_q8_many_units, &c);
    free(units);
    return 0;
}

/* moe_project for int8 experts (p->s: each expert's float32 scales). */
void moe_q8_project(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1, const int64_t *starts,
                    int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y,
                    void **scratch) {
    (void)xs;
    (void)scratch;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t e = units[u].e, r0 = units[u].g * 8;
        q8_block((const int8_t *)p->w[e], (const float *)p->s[e], r0, r0 + 8 < out ? r0 + 8 : out, out, cols, xq, xd,
                 starts[e], starts[e + 1], y);
    }
}

int kvc_moe_q8(const int64_t *w, const int64_t *scales, const int64_t *starts, int64_t experts, int64_t out,
               int64_t cols, const int8_t *xq, const float *xd, float *y, int threads) {
    const moe_proj p = {w, scales, NULL, 0};
    return moe_matmul(moe_q8_project, &p, starts, experts, out, cols, xq, xd, NULL, y, threads);
}

/* ---- int8 weights kept as panels -------------------------------------------------------- */

/* A panel: Q8P output rows of an int8 weight (kvc_pack_q8), block after block; in a block, for
 * chunk c (inputs 4c..4c+3 of the activations' reordered block), those 4 weights of each row
 * side by side (64 bytes at b * 512 + 64c), each + 128 as an unsigned byte (the 8-bit dot
 * product takes one unsigned operand; its bias comes off as 128 x the activations' sum). A
 * lane per output row: a block's exact integer dot product needs no horizontal sum, where the
 * row layout spends one per block, weight row and activation row. Each output's float
 * operations: acc = 0, then per block in order acc = fma(dot, activation scale, acc), then
 * acc x the row's scale; every path below (AVX-512, AVX2; any row count) does exactly these. */
#define Q8P 16
#define Q8P_BYTES (Q8P * BLOCK)
/* Activation rows a pass over a panel takes: with AVX-512, 8 (16 registers of sums and
 * accumulators of 32); with AVX2, 4 (2 x 4 accumulators and 4 sums of 16). */
#define Q8P_MR 8

static void pack_q8_panels(void *ctx, int64_t p0, int64_t p1, int thread) {
    (void)thread;
    const int64_t *a = ctx;
    const int8_t *w = (const int8_t *)a[0];
    const int64_t cols = a[1], blocks = cols / BLOCK;
    uint8_t *pw = (uint8_t *)a[2];
    for (int64_t p = p0; p < p1; p++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = pw + (p * blocks + b) * Q8P_BYTES;
            for (int j = 0; j < Q8P; j++) {
                const int8_t *src = w + (p * Q8P + j) * cols + b * BLOCK;
                for (int k = 0; k < BLOCK; k++) {  /* byte k of the reordered block: input 2k, or 2(k - 16) + 1 */
                    const int input = k < BLOCK / 2 ? 2 * k : 2 * (k - BLOCK / 2) + 1;
                    dst[(k / 4) * 64 + j * 4 + k % 4] = (uint8_t)(src[input] + 128);
                }
            }
        }
}

int kvc_pack_q8(const int8_t *w, int64_t out, int64_t cols, uint8_t *pw, int threads) {
    if (out % Q8P || cols % BLOCK) return -2;
    const int64_t a[3] = {(int64_t)w, cols, (int64_t)pw};
    pool_for(threads, out / Q8P, 8, pack_q8_panels, (void *)a);
    return 0;
}

/* N activation rows (a constant at each call site) against panel pp (its rows' scales sc) into
 * y (row a at y + a * out); sums[a * blocks + b]: 128 x row a's block b's sum of activations. */
static inline AVX512 __attribute__((always_inline)) void q8p_tile_wide(
        const uint8_t *pp, const float *sc, int64_t blocks, int64_t cols, const int8_t *xq, const float *xd,
        const int32_t *sums, float *y, int64_t out, const int N) {
    __m512 acc[Q8P_MR];
    for (int a = 0; a < N; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = pp + b * Q8P_BYTES;
        for (int l = 0; l < Q8P_BYTES; l += 64) _mm_prefetch((const char *)(wb + PREFETCH + l), _MM_HINT_T0);
        __m512i s[Q8P_MR];
        for (int a = 0; a < N; a++) s[a] = _mm512_set1_epi32(-sums[a * blocks + b]);
        for (int c = 0; c < 8; c++) {
            const __m512i wv = _mm512_load_si512((const void *)(wb + 64 * c));
            for (int a = 0; a < N; a++) {
                int32_t four;  /* memcpy: an unaligned 4-byte load, without aliasing */
                memcpy(&four, xq + a * cols + b * BLOCK + 4 * c, 4);
                s[a] = _mm512_dpbusd_epi32(s[a], wv, _mm512_set1_epi32(four));
            }
        }
        for (int a = 0; a < N; a++)
            acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[a]), _mm512_set1_ps(xd[a * blocks + b]), acc[a]);
    }
    const __m512 ws = _mm512_loadu_ps(sc);
    for (int a = 0; a < N; a++) _mm512_storeu_ps(y + a * out, _mm512_mul_ps(acc[a], ws));
}

/* q8p_tile_wide on AVX2, the panel's halves in two vectors: the weight's sign moved onto the
 * activations (|w| <= 128 x |x| <= 127, two a 16-bit sum: no saturation), the same integer
 * dot products, the same float operations per output. */
static inline __attribute__((always_inline)) void q8p_tile(const uint8_t *pp, const float *sc, int64_t blocks,
                                                           int64_t cols, const int8_t *xq, const float *xd, float *y,
                                                           int64_t out, const int N) {
    __m256 acc[TILE][2];
    for (int a = 0; a < N; a++) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    const __m256i bias = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = pp + b * Q8P_BYTES;
        for (int l = 0; l < Q8P_BYTES; l += 64) _mm_prefetch((const char *)(wb + PREFETCH + l), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i s[TILE];
            for (int a = 0; a < N; a++) s[a] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_xor_si256(_mm256_load_si256((const __m256i *)(wb + 64 * c + 32 * h)), bias);
                const __m256i wabs = _mm256_abs_epi8(w);  /* -128's: 0x80, read as the unsigned 128 */
                for (int a = 0; a < N; a++) {
                    int32_t four;
                    memcpy(&four, xq + a * cols + b * BLOCK + 4 * c, 4);
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
                    s[a] = _mm256_add_epi32(s[a], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x), ones));
                }
            }
            for (int a = 0; a < N; a++)
                acc[a][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[a]), _mm256_set1_ps(xd[a * blocks + b]), acc[a][h]);
        }
    }
    for (int a = 0; a < N; a++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(y + a * out + 8 * h, _mm256_mul_ps(acc[a][h], _mm256_loadu_ps(sc + 8 * h)));
}

typedef struct {
    const uint8_t *pw; const float *scales; int64_t out, cols; const int8_t *xq; const float *xd; const int32_t *sums;
    int64_t rows; float *y;
} q8p_call;

/* Panels p0..p1-1 of call c for every activation row, in passes of at most MR rows of even size
 * (9 rows with 8: 5 and 4, not 8 and 1); PASS(n) multiplies n rows (a constant) at pp, xa, da,
 * sa, ya against the panel. */
#define Q8P_PASSES(MR, PASS) do {                                                                  \
        const int64_t blocks = c->cols / BLOCK, passes = (c->rows + (MR) - 1) / (MR);              \
        for (int64_t p = p0; p < p1; p++) {                                                        \
            const uint8_t *pp = c->pw + p * blocks * Q8P_BYTES;                                    \
            const float *sc = c->scales + p * Q8P;                                                 \
            for (int64_t i = 0, a = 0; i < passes; i++) {                                          \
                const int64_t n = (c->rows - a) / (passes - i);                                    \
                const int8_t *xa = c->xq + a * c->cols;                                            \
                const float *da = c->xd + a * blocks;                                              \
                const int32_t *sa = c->sums + a * blocks;                                          \
                float *ya = c->y + a * c->out + p * Q8P;                                           \
                PASS;                                                                              \
                a += n;                                                                            \
            }                                                                                      \
        }                                                                                          \
    } while (0)

static AVX512 void q8p_panels_wide(const q8p_call *c, int64_t p0, int64_t p1) {
#define ROWS(n) q8p_tile_wide(pp, sc, blocks, c->cols, xa, da, sa, ya, c->out, n)
    Q8P_PASSES(Q8P_MR, if (n == Q8P_MR) ROWS(Q8P_MR); else LAST_ROWS_OF_8(n, ROWS));
#undef ROWS
}

static void q8p_panels(void *ctx, int64_t p0, int64_t p1, int thread) {
    (void)thread;
    const q8p_call *c = ctx;
    if (avx512_cpu()) {
        q8p_panels_wide(c, p0, p1);
        return;
    }
#define ROWS(n) q8p_tile(pp, sc, blocks, c->cols, xa, da, ya, c->out, n)
    Q8P_PASSES(TILE, (void)sa; if (n == TILE) ROWS(TILE); else LAST_ROWS_OF_4(n, ROWS));
#undef ROWS
}
#undef Q8P_PASSES

/* 128 x each block's sum of activations (rows x blocks of them, for q8p_tile_wide), or NULL
 * without memory. */
static int32_t *q8p_sums(const int8_t *xq, int64_t rows, int64_t blocks) {
    int32_t *sums = malloc((size_t)(rows * blocks) * sizeof(int32_t));
    if (!sums) return NULL;
    for (int64_t i = 0; i < rows * blocks; i++) {
        int32_t s = 0;
        for (int k = 0; k < BLOCK; k++) s += xq[i * BLOCK + k];
        sums[i] = 128 * s;
    }
    return sums;
}

/* y [rows, out] float32 = x @ w.T for int8 weights kept as panels (pw: kvc_pack_q8's, scales:
 * float32 [out], out a multiple of Q8P). */
int kvc_gemm_q8p(const uint8_t *pw, const float *scales, int64_t out, int64_t cols, const int8_t *xq,
                 const float *xd, int64_t rows, float *y, int threads) {
    const int64_t w = (int64_t)pw, s = (int64_t)scales, dst = (int64_t)y;
    return kvc_gemm_q8p_many(&w, &s, &out, &dst, 1, cols, xq, xd, rows, threads);
}

/* kvc_gemm_q8p for weights that take the same activations, one after the other (their sums
 * taken once). */
int kvc_gemm_q8p_many(const int64_t *w, const int64_t *scales, const int64_t *outs, const int64_t *ys, int64_t count,
                      int64_t cols, const int8_t *xq, const float *xd, int64_t rows, int threads) {
    for (int64_t i = 0; i < count; i++)
        if (outs[i] % Q8P || cols % BLOCK) return -2;
    if (rows <= 0) return 0;
    int32_t *sums = q8p_sums(xq, rows, cols / BLOCK);
    if (!sums) return -1;
    for (int64_t i = 0; i < count; i++) {
        q8p_call c = {(const uint8_t *)w[i], (const float *)scales[i], outs[i], cols, xq, xd, sums, rows,
                      (float *)ys[i]};
        pool_for(threads, outs[i] / Q8P, ROW_GROUPS / 2, q8p_panels, &c);
    }
    free(sums);
    return 0;
}
