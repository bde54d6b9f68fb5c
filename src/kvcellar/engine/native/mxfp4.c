#include "kvc.h"

/* ---- MXFP4 (OCP microscaling FP4, gpt-oss's experts) ----------------------------------
 * Layout: nibbles uint8 [out, in / 2] as int4's (input 2j low, 2j + 1 high), each an E2M1 code,
 * and per block of 32 inputs one E8M0 exponent byte e: w = value(code) * 2^(e - 127). The
 * values doubled are integers (0, 1, 2, 3, 4, 6, 8, 12 and their negatives), so a block's dot
 * product with the 8-bit activations is exact in integers, and the block scale (halved) a
 * power of two. A row kernel for decode-sized steps and panels for prefill-sized ones, each
 * output summed in the same order by both: each activation row's numbers are its own. */

/* 2^(e - 128), the block scale of the doubled values (e < 2: a subnormal float): one exponent
 * byte, and 8 at once. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* E2M1 codes (the table's index) as their values doubled: integers. */
static inline __m256i mx_values(void) {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

static inline __m256 e8m0_half8(const uint8_t *e8) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* Blocks of a row per pass of mx_rows8: its activations in pairs (TILE x 8 KB) and its dot
 * products (TILE x 8 KB) stay in L1. Even, so that pairs of blocks do not straddle passes. */
#define MX_CHUNK 256

/* Output rows r0..r0+7 of MXFP4 weights (w, exps: the whole matrix) against n <= TILE activation
 * rows, read as they lie. A 32-byte load holds two blocks of a row: its low nibbles the even
 * inputs of both, its high nibbles the odd ones, so the activations are first put in pairs to
 * match (each pair of blocks: both blocks' even inputs, then both blocks' odd ones). Codes
 * become their doubled values by a table lookup; signs move onto the activations, as the 8-bit
 * dot product takes one unsigned operand. The exact integer dot products of 8 blocks land in
 * one vector (lanes: blocks 0 2 4 6 1 3 5 7); then lane j accumulates output r0 + j with the
 * panel's float operations in its order (mx_panel_tile): per block acc = fma(dot, ws * xd,
 * acc). So an output is the same bits whichever kernel and however many rows a step has. Rows
 * past `out` repeat the last one and are not stored. */
static inline void mx_rows8(const uint8_t *w, const uint8_t *exps, int64_t r0, int64_t out, int64_t blocks,
                            const int8_t *xq, const float *xd, int n, float *y) {
    const __m256i values = mx_values();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t *wr[8], *er[8];
    for (int j = 0; j < 8; j++) {
        const int64_t r = r0 + j < out ? r0 + j : out - 1;
        wr[j] = w + r * blocks * (BLOCK / 2);
        er[j] = exps + r * blocks;
    }
    __m256 acc[TILE];
    for (int a = 0; a < n; a++) acc[a] = _mm256_setzero_ps();
    __attribute__((aligned(32))) int8_t pairs[TILE][MX_CHUNK * BLOCK];
    __attribute__((aligned(32))) int32_t dots[TILE][8][MX_CHUNK];  /* [activation row][weight row][block] */
    for (int64_t c0 = 0; c0 < blocks; c0 += MX_CHUNK) {
        const int64_t nc = blocks - c0 < MX_CHUNK ? blocks - c0 : MX_CHUNK;
        for (int a = 0; a < n; a++)
            for (int64_t b = 0; b < nc; b += 2) {
                const int8_t *x0 = xq + (a * blocks + c0 + b) * BLOCK;
                const __m256i first = _mm256_loadu_si256((const __m256i *)x0);
                const __m256i second = b + 1 < nc ? _mm256_loadu_si256((const __m256i *)(x0 + BLOCK)) : _mm256_setzero_si256();
                _mm256_store_si256((__m256i *)(pairs[a] + b * BLOCK), _mm256_permute2x128_si256(first, second, 0x20));
                _mm256_store_si256((__m256i *)(pairs[a] + b * BLOCK + 32), _mm256_permute2x128_si256(first, second, 0x31));
            }
        for (int j = 0; j < 8; j++) {
            const uint8_t *wb = wr[j] + c0 * (BLOCK / 2);
            for (int64_t k0 = 0; k0 < nc; k0 += 8) {
                _mm_prefetch((const char *)(wb + k0 * (BLOCK / 2) + PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + k0 * (BLOCK / 2) + PREFETCH + 64), _MM_HINT_T0);
                if ((k0 & 63) == 0) _mm_prefetch((const char *)(er[j] + c0 + k0), _MM_HINT_T0);
                __m256i p[TILE][4];
                for (int h = 0; h < 4; h++) {
                    const int64_t b = k0 + 2 * h;
                    __m256i both = _mm256_setzero_si256();  /* blocks past the row's end: code 0, value 0 */
                    if (b + 1 < nc)
                        both = _mm256_loadu_si256((const __m256i *)(wb + b * (BLOCK / 2)));
                    else if (b < nc)
                        both = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(wb + b * (BLOCK / 2))));
                    const __m256i even = _mm256_shuffle_epi8(values, _mm256_and_si256(both, low));
                    const __m256i odd = _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(both, 4), low));
                    const __m256i even_abs = _mm256_sign_epi8(even, even), odd_abs = _mm256_sign_epi8(odd, odd);
                    for (int a = 0; a < n; a++) {
                        const int8_t *xp = pairs[a] + b * BLOCK;
                        const __m256i xe = _mm256_sign_epi8(_mm256_load_si256((const __m256i *)xp), even);
                        const __m256i xo = _mm256_sign_epi8(_mm256_load_si256((const __m256i *)(xp + 32)), odd);
                        /* 16-bit lanes: at most 2 x 2 x 12 x 127 */
                        p[a][h] = _mm256_add_epi16(_mm256_maddubs_epi16(even_abs, xe), _mm256_maddubs_epi16(odd_abs, xo));
                    }
                }
                for (int a = 0; a < n; a++) {  /* 4 then 8 lanes summed in 16 bits (<= 16 x 12 x 127), then 32 */
                    const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[a][0], p[a][1]), _mm256_hadd_epi16(p[a][2], p[a][3]));
                    _mm256_store_si256((__m256i *)(dots[a][j] + k0), _mm256_madd_epi16(h, ones));
                }
            }
        }
        for (int64_t k0 = 0; k0 < nc; k0 += 8) {
            const int64_t b0 = c0 + k0;
            const int nb = nc - k0 < 8 ? (int)(nc - k0) : 8;
            __m256 ws[8];
            if (nb == 8) {  /* each row's 8 scales, transposed to 8 rows per block */
                for (int j = 0; j < 8; j++) ws[j] = e8m0_half8(er[j] + b0);
                transpose8(ws);
            } else {
                for (int k = 0; k < nb; k++) {
                    float s8[8];
                    for (int j = 0; j < 8; j++) s8[j] = e8m0_half(er[j][b0 + k]);
                    ws[k] = _mm256_loadu_ps(s8);
                }
            }
            for (int a = 0; a < n; a++) {
                __m256 d[8];
                for (int j = 0; j < 8; j++) d[j] = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(dots[a][j] + k0)));
                transpose8(d);  /* d[i] lane j: row j's dot product of block b0 + 2i (i < 4) or b0 + 2(i - 4) + 1 */
                for (int k = 0; k < nb; k++)
                    acc[a] = _mm256_fmadd_ps(d[(k & 1) * 4 + k / 2], _mm256_mul_ps(ws[k], _mm256_set1_ps(xd[a * blocks + b0 + k])),
                                             acc[a]);
            }
        }
    }
    store8(acc, n, r0, out, y);
}

/* Prefill-sized steps: 8 output rows at a time as a panel (panel_nibbles: one 32-byte load
 * holds 4 + 4 inputs of each row) against MX_MR activation rows, each lane one output. A
 * block's products are summed in 16 bits (16 x 12 x 127 < 2^15: exact) and scaled once, where
 * mx_rows8 reduces every block across lanes. */
#define MX_MR 4

/* A thread's panel: nibbles (blocks x 128 bytes) and its rows' exponents (8 a block). */
typedef struct { uint8_t *nibbles, *exps; } mx_panel;

/* A thread's panel, in one allocation kept in *slot from its first use ({NULL, NULL} where there
 * was no memory: the row kernel runs). */
static mx_panel mx_panel_of(void **slot, int64_t blocks) {
    const size_t nbytes = ((size_t)blocks * PANEL * BLOCK / 2 + 63) / 64 * 64;
    if (!*slot) *slot = aligned_alloc(64, nbytes + ((size_t)blocks * PANEL + 63) / 64 * 64);
    uint8_t *base = *slot;
    return base ? (mx_panel){base, base + nbytes} : (mx_panel){NULL, NULL};
}

static void mx_pack(const uint8_t *w, const uint8_t *exps, int64_t r0, int64_t blocks, mx_panel p) {
    for (int64_t b = 0; b < blocks; b++) {
        panel_nibbles(w, blocks, r0, b, p.nibbles + b * (PANEL * BLOCK / 2));
        for (int j = 0; j < PANEL; j++) p.exps[b * PANEL + j] = exps[(r0 + j) * blocks + b];
    }
}

/* N activation rows (N <= MX_MR, a constant at each call site) against a packed panel: y[a *
 * out + 0..7]. Chunk c's low nibbles are inputs 4c..4c+3 of the activations' reordered block,
 * its high nibbles inputs 16 + 4c.. */
static inline __attribute__((always_inline)) void mx_panel_tile(mx_panel p, int step, int64_t blocks,
                                                                const int8_t *xq, const float *xd, int64_t cols,
                                                                float *y, int64_t out, const int N) {
    const __m256i values = mx_values();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MX_MR];
    for (int a = 0; a < N; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sum[MX_MR];
        for (int a = 0; a < N; a++) sum[a] = _mm256_setzero_si256();
        const uint8_t *pb = p.nibbles + b * step * (PANEL * BLOCK / 2);
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_load_si256((const __m256i *)(pb + 32 * c));
            const __m256i lo = _mm256_shuffle_epi8(values, _mm256_and_si256(raw, low));
            const __m256i hi = _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
            const __m256i lo_abs = _mm256_sign_epi8(lo, lo), hi_abs = _mm256_sign_epi8(hi, hi);
            for (int a = 0; a < N; a++) {
                const int8_t *xb = xq + a * cols + b * BLOCK;
                int32_t four_lo, four_hi;  /* memcpy: an unaligned 4-byte load, without aliasing */
                memcpy(&four_lo, xb + 4 * c, 4);
                memcpy(&four_hi, xb + 16 + 4 * c, 4);
                const __m256i xl = _mm256_sign_epi8(_mm256_set1_epi32(four_lo), lo);
                const __m256i xh = _mm256_sign_epi8(_mm256_set1_epi32(four_hi), hi);
                sum[a] = _mm256_add_epi16(sum[a], _mm256_add_epi16(_mm256_maddubs_epi16(lo_abs, xl),
                                                                   _mm256_maddubs_epi16(hi_abs, xh)));
            }
        }
        const __m256 ws = e8m0_half8(p.exps + b * step * PANEL);
        for (int a = 0; a < N; a++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[a], ones));
            acc[a] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws, _mm256_set1_ps(xd[a * blocks + b])), acc[a]);
        }
    }
    for (int a = 0; a < N; a++) _mm256_storeu_ps(y + a * out, acc[a]);
}

/* Activation rows a0..a1-1 against a panel (its blocks at `step` blocks' room) into y (the panel's
 * first output column). */
static void mx_panel_tiles(mx_panel p, int step, int64_t blocks, int64_t cols, const int8_t *xq, const float *xd,
                           int64_t a0, int64_t a1, float *y, int64_t out) {
    int64_t a = a0;
    for (; a + MX_MR <= a1; a += MX_MR)
        mx_panel_tile(p, step, blocks, xq + a * cols, xd + a * blocks, cols, y + a * out, out, MX_MR);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks;
    float *ya = y + a * out;
#define ROWS(n) mx_panel_tile(p, step, blocks, xa, da, cols, ya, out, n)
    LAST_ROWS_OF_4(a1 - a, ROWS);
#undef ROWS
}

/* Output rows g * 8 .. g * 8 + 7 of MXFP4 weights against activation rows a0..a1-1: as a panel
 * where there are a panel's worth of rows (and memory for it, and out is a multiple of 8), else
 * by the row kernel. The same bits either way. */
static inline void mx_unit(const uint8_t *w, const uint8_t *exps, int64_t g, int64_t out, int64_t blocks,
                           int64_t cols, const int8_t *xq, const float *xd, int64_t a0, int64_t a1, float *y,
                           mx_panel p) {
    if (a1 - a0 >= PANEL && out % PANEL == 0 && p.nibbles && p.exps) {
        mx_pack(w, exps, g * PANEL, blocks, p);
        mx_panel_tiles(p, 1, blocks, cols, xq, xd, a0, a1, y + g * PANEL, out);
        return;
    }
    for (int64_t a = a0; a < a1; a += TILE)
        mx_rows8(w, exps, g * 8, out, blocks, xq + a * cols, xd + a * blocks, a1 - a < TILE ? (int)(a1 - a) : TILE,
                 y + a * out);
}

/* ---- MXFP4 weights kept in the panel layout --------------------------------------------
 * As int4's (int4.c): each 8 rows' codes as panel_nibbles lays them and their exponents 8 a
 * block, in the place of the same rows (the tensors keep their shapes), pairs of panels
 * interleaved block by block where two are multiplied at once (kept_panel_offset). A decode
 * step then reads one stream where the row kernel reads 8 (its rows' bytes lie apart), and a
 * prefill packs nothing. Every output's float operations are mx_rows8's, in its order. */

/* Panel p (of `panels`) of a weight kept as panels, and its blocks' step. */
static inline mx_panel mx_kept_at(const uint8_t *pw, const uint8_t *pe, int64_t p, int64_t panels, int64_t blocks,
                                  int *step) {
    const int64_t at = kept_panel_offset(p, panels, blocks, step);
    return (mx_panel){(uint8_t *)pw + at * (BLOCK / 2), (uint8_t *)pe + at};
}

void kvc_pack_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t out, int64_t cols, uint8_t *pw, uint8_t *pe,
                    int threads) {
    const int64_t blocks = cols / BLOCK, panels = out / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        int step;
        const mx_panel k = mx_kept_at(pw, pe, p, panels, blocks, &step);
        for (int64_t b = 0; b < blocks; b++) {
            panel_nibbles(w, blocks, p * PANEL, b, k.nibbles + b * step * (PANEL * BLOCK / 2));
            for (int j = 0; j < PANEL; j++) k.exps[b * step * PANEL + j] = exps[(p * PANEL + j) * blocks + b];
        }
    }
}

/* The row layout back from the panel layout (dequantizing reads rows). */
void kvc_unpack_mxfp4(const uint8_t *pw, const uint8_t *pe, int64_t out, int64_t cols, uint8_t *w, uint8_t *exps,
                      int threads) {
    const int64_t blocks = cols / BLOCK, panels = out / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        int step;
        const mx_panel k = mx_kept_at(pw, pe, p, panels, blocks, &step);
        unpack_panel_nibbles(k.nibbles, step, p * PANEL, blocks, w);
        for (int64_t b = 0; b < blocks; b++)
            for (int j = 0; j < PANEL; j++) exps[(p * PANEL + j) * blocks + b] = k.exps[b * step * PANEL + j];
    }
}

/* The two panels of a pair at once with AVX-512's 8-bit dot product (int4.c's pair_tile for
 * MXFP4): chunk c of both in one 64-byte vector, lanes 0-7 the first panel's rows, 8-15 the
 * second's. The dot product takes unsigned weights, so each code's magnitude (doubled) comes
 * from a table and its sign moves onto the activations (negated under the code's sign bit; they
 * are within +-127). A block's sum is the exact integer mx_panel_tile finds, and each output's
 * float operations its own, in its order: its bits at every row count. */
#define MX_MR2 8
/* Bytes ahead in the pair's nibbles that a block asks for (its exponents: a line per 4 blocks). */
#define MX_PREFETCH 4096

static inline AVX512 __m512 e8m0_half16(const uint8_t *e16) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e16));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}

static inline AVX512 __attribute__((always_inline)) void mx_pair_tile(const uint8_t *pw, const uint8_t *pe,
                                                                     int64_t blocks, const int8_t *xq,
                                                                     const float *xd, int64_t cols, float *y,
                                                                     int64_t out, const int N) {
    const __m512i magnitudes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12));
    const __m512i low = _mm512_set1_epi8(0x0F), sign_low = _mm512_set1_epi8(0x08);
    const __m512i sign_high = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc[MX_MR2];
    for (int a = 0; a < N; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[MX_MR2];
        for (int a = 0; a < N; a++) sum[a] = _mm512_setzero_si512();
        const uint8_t *w = pw + b * (2 * PANEL * BLOCK / 2);  /* the first panel's 128 bytes, then the second's */
        for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(w + MX_PREFETCH + 64 * line), _MM_HINT_T0);
        if ((b & 3) == 0) _mm_prefetch((const char *)(pe + b * 2 * PANEL + MX_PREFETCH / 16), _MM_HINT_T0);
        for (int c = 0; c < 4; c++) {
            const __m512i raw = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(w + 32 * c))),
                _mm256_load_si256((const __m256i *)(w + PANEL * BLOCK / 2 + 32 * c)), 1);
            const __m512i lo = _mm512_shuffle_epi8(magnitudes, _mm512_and_si512(raw, low));
            const __m512i hi = _mm512_shuffle_epi8(magnitudes, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
            const __mmask64 lo_neg = _mm512_test_epi8_mask(raw, sign_low);
            const __mmask64 hi_neg = _mm512_test_epi8_mask(raw, sign_high);
            for (int a = 0; a < N; a++) {
                const int8_t *xb = xq + a * cols + b * BLOCK;
                int32_t four_lo, four_hi;
                memcpy(&four_lo, xb + 4 * c, 4);
                memcpy(&four_hi, xb + 16 + 4 * c, 4);
                const __m512i xl = _mm512_set1_epi32(four_lo), xh = _mm512_set1_epi32(four_hi);
                sum[a] = _mm512_dpbusd_epi32(sum[a], lo, _mm512_mask_sub_epi8(xl, lo_neg, zero, xl));
                sum[a] = _mm512_dpbusd_epi32(sum[a], hi, _mm512_mask_sub_epi8(xh, hi_neg, zero, xh));
            }
        }
        const __m512 ws = e8m0_half16(pe + b * 2 * PANEL);
        for (int a = 0; a < N; a++)
            acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[a]), _mm512_mul_ps(ws, _mm512_set1_ps(xd[a * blocks + b])),
                                     acc[a]);
    }
    for (int a = 0; a < N; a++) _mm512_storeu_ps(y + a * out, acc[a]);
}

/* Pair p, p + 1 (kept interleaved) against activation rows a0..a1-1; y: the weight's output. */
static AVX512 void mx_pair_rows(const uint8_t *pw, const uint8_t *pe, int64_t blocks, int64_t cols,
                                const int8_t *xq, const float *xd, int64_t a0, int64_t a1, float *y, int64_t out) {
    int64_t a = a0;
    for (; a + MX_MR2 <= a1; a += MX_MR2)
        mx_pair_tile(pw, pe, blocks, xq + a * cols, xd + a * blocks, cols, y + a * out, out, MX_MR2);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks;
    float *ya = y + a * out;
#define ROWS(n) mx_pair_tile(pw, pe, blocks, xa, da, cols, ya, out, n)
    LAST_ROWS_OF_8(a1 - a, ROWS);
#undef ROWS
}

/* The unit of a weight kept as panels that starts at panel p (a pair, or one panel) against
 * activation rows a0..a1-1 into y (the weight's output of row 0). */
static void mx_kept_unit(const uint8_t *pw, const uint8_t *pe, int64_t p, int64_t panels, int64_t blocks,
                         int64_t cols, const int8_t *xq, const float *xd, int64_t a0, int64_t a1, float *y,
                         int64_t out) {
    int step;
    const mx_panel k = mx_kept_at(pw, pe, p, panels, blocks, &step);
    if (unit_is_pair(p, panels))
        mx_pair_rows(k.nibbles, k.exps, blocks, cols, xq, xd, a0, a1, y + p * PANEL, out);
    else
        mx_panel_tiles(k, step, blocks, cols, xq, xd, a0, a1, y + p * PANEL, out);
}

typedef struct {
    const uint8_t *w, *exps; int64_t out, cols; const int8_t *xq; const float *xd; int64_t rows; float *y;
    void **scratch;
} mx_call;

static void gemm_mxp_units(void *ctx, int64_t u0, int64_t u1, int thread) {
    (void)thread;
    const mx_call *c = ctx;
    const int64_t blocks = c->cols / BLOCK, panels = c->out / PANEL, unit = q4_panel_step();
    for (int64_t u = u0; u < u1; u++)
        mx_kept_unit(c->w, c->exps, u * unit, panels, blocks, c->cols, c->xq, c->xd, 0, c->rows, c->y, c->out);
}

/* kvc_gemm_mxfp4 for a weight kept as panels (kvc_pack_mxfp4; out a multiple of 8), at any row
 * count: the same bits. */
void kvc_gemm_mxfp4p(const uint8_t *pw, const uint8_t *pe, int64_t out, int64_t cols, const int8_t *xq,
                     const float *xd, int64_t rows, float *y, int threads) {
    const int64_t unit = q4_panel_step(), units = (out / PANEL + unit - 1) / unit;
    mx_call c = {pw, pe, out, cols, xq, xd, rows, y, NULL};
    pool_for(threads, units, rows < PANEL ? ROW_GROUPS / unit : 1, gemm_mxp_units, &c);
}

static void gemm_mx_groups(void *ctx, int64_t g0, int64_t g1, int thread) {
    const mx_call *c = ctx;
    const int64_t blocks = c->cols / BLOCK;
    const mx_panel p = c->rows >= PANEL ? mx_panel_of(&c->scratch[thread], blocks) : (mx_panel){NULL, NULL};
    for (int64_t g = g0; g < g1; g++) mx_unit(c->w, c->exps, g, c->out, blocks, c->cols, c->xq, c->xd, 0, c->rows, c->y, p);
}

/* y [rows, out] float32 = x @ w.T for MXFP4 weights: 8 output rows at a time, as panels where
 * there are a panel's worth of activation rows. */
void kvc_gemm_mxfp4(const uint8_t *w, const uint8_t *exps, int64_t out, int64_t cols, const int8_t *xq,
                    const float *xd, int64_t rows, float *y, int threads) {
    void *scratch[POOL_THREADS] = {0};
    mx_call c = {w, exps, out, cols, xq, xd, rows, y, scratch};
    pool_for(threads, (out + 7) / 8, rows >= PANEL ? 1 : ROW_GROUPS, gemm_mx_groups, &c);
    free_scratch(scratch, threads > 0 ? threads : 1);
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

/* moe_project for MXFP4 experts (p->s: each expert's exponents); a panel packed in the thread's
 * scratch where an expert has a panel's worth of slots. */
void moe_mx_project(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1, const int64_t *starts,
                    int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y,
                    void **scratch) {
    (void)xs;
    const int64_t blocks = cols / BLOCK;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t e = units[u].e, a0 = starts[e], a1 = starts[e + 1];
        if (p->panels) {
            mx_kept_unit((const uint8_t *)p->w[e], (const uint8_t *)p->s[e], units[u].g, out / PANEL, blocks, cols, xq,
                         xd, a0, a1, y, out);
            continue;
        }
        mx_unit((const uint8_t *)p->w[e], (const uint8_t *)p->s[e], units[u].g, out, blocks, cols, xq, xd, a0, a1, y,
                a1 - a0 >= PANEL ? mx_panel_of(scratch, blocks) : (mx_panel){NULL, NULL});
    }
}

int kvc_moe_mxfp4(const int64_t *w, const int64_t *exps, const int64_t *starts, int64_t experts, int64_t out,
                  int64_t cols, const int8_t *xq, const float *xd, float *y, int threads) {
    const moe_proj p = {w, exps, NULL, 0};
    return moe_matmul(moe_mx_project, &p, starts, experts, out, cols, xq, xd, NULL, y, threads);
}

/* kvc_moe_mxfp4 for experts kept as panels (out a multiple of 8). */
int kvc_moe_mxfp4p(const int64_t *w, const int64_t *exps, const int64_t *starts, int64_t experts, int64_t out,
                   int64_t cols, const int8_t *xq, const float *xd, float *y, int threads) {
    if (out % PANEL) return -2;
    const moe_proj p = {w, exps, NULL, 1};
    return moe_matmul(moe_mx_project, &p, starts, experts, out, cols, xq, xd, NULL, y, threads);
}
