/* int4 linears: weights kept as panels of 8 rows (kvc_pack_q4) are multiplied as they lie at
 * every row count (kvc_gemm_q4p; two panels at once with AVX-512's 8-bit dot product); weights in
 * the row layout are read row by row for decode-sized steps (kvc_gemm_q4) and packed into panels
 * for prefill-sized ones (kvc_gemm_q4_panels; 16 rows with AVX-512, kvc_gemm_q4_panels16). Every
 * one sums each output in the same order, so a row's outputs are the same bits whatever the
 * step's row count and the CPU. Also a MoE layer's routed experts in one call, and the weights
 * dequantized for a dense fallback. */
#include "kvc.h"

/* Lane j of the result: the sum of the 16 int16 lanes of m[j] (maddubs of a block: each lane
 * at most 2 x 15 x 127), exact. The halves of a block (low and high nibbles) are summed in
 * 16 bits within their 128-bit lane (at most 16 x 15 x 127 = 30480), then added in 32. */
static inline __m256i block_dots8(const __m256i *m) {
    const __m256i a01 = _mm256_hadd_epi16(m[0], m[1]), a23 = _mm256_hadd_epi16(m[2], m[3]);
    const __m256i a45 = _mm256_hadd_epi16(m[4], m[5]), a67 = _mm256_hadd_epi16(m[6], m[7]);
    const __m256i b0 = _mm256_hadd_epi16(a01, a23), b1 = _mm256_hadd_epi16(a45, a67);
    const __m256i c = _mm256_hadd_epi16(b0, b1);  /* lane j: row j's low half; lane 8 + j: its high half */
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(c)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(c, 1)));
}

/* Blocks of a row whose dot products a pass of q4_rows8 keeps (for TILE activation rows and 8
 * output rows: 32 KB, an L1's worth). */
#define ROW_CHUNK 640

/* Output rows r0..r0+7 against n <= TILE activation rows, read as they lie (no packing: a
 * decode step reads each weight once). Lane j accumulates output r0 + j with the float
 * operations of a panel (panel_tile), in its order: per block the exact integer dot product,
 * then acc = fma(dot, ws * xd, acc) and acc = fma(wo, xs, acc). So a row's output is the same
 * to the bit whichever kernel and however many rows a step has: a token's numbers do not
 * depend on the step it runs in. The integer dot products of a chunk of blocks are taken one
 * weight row after the other (one stream of memory at a time, as the weights lie), then the
 * float sums run across the 8 rows. Rows past `out` repeat the last one and are not stored. */
static inline void q4_rows8(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t r0,
                            int64_t out, int64_t blocks, const int8_t *xq, const float *xd, const float *xs, int n,
                            float *y) {
    const int64_t stride = blocks * (BLOCK / 2);
    const uint8_t *wr[8];
    const uint16_t *sr[8], *orow[8];
    for (int j = 0; j < 8; j++) {
        const int64_t r = r0 + j < out ? r0 + j : out - 1;
        wr[j] = w + r * stride;
        sr[j] = scales + r * blocks;
        orow[j] = offsets + r * blocks;
    }
    __m256 acc[TILE];
    for (int a = 0; a < n; a++) acc[a] = _mm256_setzero_ps();
    __attribute__((aligned(32))) int32_t dots[TILE][8][ROW_CHUNK];  /* [activation row][weight row][block] */
    for (int64_t c0 = 0; c0 < blocks; c0 += ROW_CHUNK) {
        const int64_t nc = blocks - c0 < ROW_CHUNK ? blocks - c0 : ROW_CHUNK;
        for (int j = 0; j < 8; j++) {
            const uint8_t *wb = wr[j] + c0 * (BLOCK / 2);
            for (int64_t k0 = 0; k0 < nc; k0 += 8) {
                _mm_prefetch((const char *)(wb + k0 * (BLOCK / 2) + PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + k0 * (BLOCK / 2) + PREFETCH + 64), _MM_HINT_T0);
                if ((k0 & 31) == 0) {  /* the float pass's scales and offsets (their own arrays): a line each */
                    _mm_prefetch((const char *)(sr[j] + c0 + k0), _MM_HINT_T0);
                    _mm_prefetch((const char *)(orow[j] + c0 + k0), _MM_HINT_T0);
                }
                const int nb = nc - k0 < 8 ? (int)(nc - k0) : 8;
                __m256i q[8];
                for (int k = 0; k < 8; k++)
                    q[k] = k < nb ? _mm256_castps_si256(q4_block(wb + (k0 + k) * (BLOCK / 2))) : _mm256_setzero_si256();
                for (int a = 0; a < n; a++) {
                    const int8_t *xa = xq + (a * blocks + c0 + k0) * BLOCK;
                    __m256i p[8];
                    for (int k = 0; k < 8; k++)
                        p[k] = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(xa + (k < nb ? k : 0) * BLOCK)));
                    _mm256_store_si256((__m256i *)(dots[a][j] + k0), block_dots8(p));
                }
            }
        }
        for (int64_t k0 = 0; k0 < nc; k0 += 8) {
            const int64_t b0 = c0 + k0;
            const int nb = nc - k0 < 8 ? (int)(nc - k0) : 8;
            __m256 ws[8], wo[8];
            if (nb == 8) {  /* each row's 8 scales, transposed to 8 rows per block */
                for (int j = 0; j < 8; j++) {
                    ws[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sr[j] + b0)));
                    wo[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(orow[j] + b0)));
                }
                transpose8(ws);
                transpose8(wo);
            } else {
                for (int k = 0; k < nb; k++) {
                    float s8[8], o8[8];
                    for (int j = 0; j < 8; j++) {
                        s8[j] = _cvtsh_ss(sr[j][b0 + k]);
                        o8[j] = _cvtsh_ss(orow[j][b0 + k]);
                    }
                    ws[k] = _mm256_loadu_ps(s8);
                    wo[k] = _mm256_loadu_ps(o8);
                }
            }
            for (int a = 0; a < n; a++) {
                __m256 d[8];
                for (int j = 0; j < 8; j++) d[j] = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(dots[a][j] + k0)));
                transpose8(d);  /* d[k] lane j: row j's dot product of block b0 + k */
                for (int k = 0; k < nb; k++) {
                    acc[a] = _mm256_fmadd_ps(d[k], _mm256_mul_ps(ws[k], _mm256_set1_ps(xd[a * blocks + b0 + k])), acc[a]);
                    acc[a] = _mm256_fmadd_ps(wo[k], _mm256_set1_ps(xs[a * blocks + b0 + k]), acc[a]);
                }
            }
        }
    }
    store8(acc, n, r0, out, y);
}

/* y [rows, out] float32 = x @ w.T for int4 weights: 8 output rows at a time, TILE activation
 * rows at a time against them. */
typedef struct {
    const uint8_t *w; const uint16_t *scales, *offsets; int64_t out, cols; const int8_t *xq; const float *xd, *xs;
    int64_t rows; float *y;
} q4_call;

static void gemm_q4_groups(void *ctx, int64_t g0, int64_t g1, int thread) {
    (void)thread;
    const q4_call *c = ctx;
    const int64_t blocks = c->cols / BLOCK;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t a0 = 0; a0 < c->rows; a0 += TILE) {
            const int n = c->rows - a0 < TILE ? (int)(c->rows - a0) : TILE;
            q4_rows8(c->w, c->scales, c->offsets, g * 8, c->out, blocks, c->xq + a0 * c->cols, c->xd + a0 * blocks,
                     c->xs + a0 * blocks, n, c->y + a0 * c->out);
        }
}

void kvc_gemm_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols,
                 const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y, int threads) {
    q4_call c = {w, scales, offsets, out, cols, xq, xd, xs, rows, y};
    pool_for(threads, (out + 7) / 8, ROW_GROUPS, gemm_q4_groups, &c);
}

/* Prefill-sized steps of int4 weights: 8 output rows at a time against MR activation rows,
 * the 8 rows' nibbles first interleaved (a "panel") so that one 32-byte load holds 4 inputs
 * of each row, and each vector lane accumulates one output. The 8-bit products of a block
 * are summed in 16 bits (8 x 2 x 15 x 127 < 2^15: exact) and scaled once a block, so a block
 * costs 8 multiply-adds of 32 pairs where kvc_gemm_q4 spends a float conversion and a lane
 * permute per 8 inputs. */
#define MR 4
/* Bytes of activations multiplied per pass over the panels: an L3's worth, so that each
 * panel is packed once for them (a pass per L2's worth repacked the weights dozens of times
 * for wide inputs). */
#define ACT_BYTES (8 * 1024 * 1024)

/* Panel p's blocks: for block b, chunk c (bytes 4c..4c+3 of each row's 16) of rows 0..7,
 * 32 bytes; scales and offsets (float16), 8 a block (no offsets where po is NULL: the
 * multiplying kernels then take -8 x the scale, Q4_0's). Block b lies at b x `step` blocks'
 * room: 1 for a panel alone, 2 for one of a pair kept interleaved (kept_panel_at). */
static void pack_panel(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t r0,
                       int64_t blocks, uint8_t *packed, uint16_t *ps, uint16_t *po, int step) {
    for (int64_t b = 0; b < blocks; b++) {
        panel_nibbles(w, blocks, r0, b, packed + b * step * (PANEL * BLOCK / 2));
        for (int j = 0; j < PANEL; j++) {
            ps[b * step * PANEL + j] = scales[(r0 + j) * blocks + b];
            if (po) po[b * step * PANEL + j] = offsets[(r0 + j) * blocks + b];
        }
    }
}

/* N activation rows (N <= MR, a constant at each call site) against one packed panel:
 * y[a * out + 0..7]. Chunk c's low nibbles are inputs 4c..4c+3 of the activations'
 * reordered block, its high nibbles inputs 16 + 4c.. */
static inline __attribute__((always_inline)) void panel_tile(
        const uint8_t *packed, const uint16_t *ps, const uint16_t *po, int step, int64_t blocks, const int8_t *xq,
        const float *xd, const float *xs, int64_t cols, dest y, int64_t out, const int N) {
    __m256 acc[MR];
    for (int a = 0; a < N; a++) acc[a] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sum[MR];
        for (int a = 0; a < N; a++) sum[a] = _mm256_setzero_si256();
        const uint8_t *pb = packed + b * step * (PANEL * BLOCK / 2);
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_load_si256((const __m256i *)(pb + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int a = 0; a < N; a++) {
                const int8_t *xb = xq + a * cols + b * BLOCK;
                int32_t four_lo, four_hi;  /* memcpy: an unaligned 4-byte load, without aliasing */
                memcpy(&four_lo, xb + 4 * c, 4);
                memcpy(&four_hi, xb + 16 + 4 * c, 4);
                const __m256i xl = _mm256_set1_epi32(four_lo), xh = _mm256_set1_epi32(four_hi);
                sum[a] = _mm256_add_epi16(sum[a], _mm256_maddubs_epi16(lo, xl));
                sum[a] = _mm256_add_epi16(sum[a], _mm256_maddubs_epi16(hi, xh));
            }
        }
        const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ps + b * step * PANEL)));
        const __m256 wo = po ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(po + b * step * PANEL)))
                             : _mm256_mul_ps(ws, _mm256_set1_ps(-8.0f));  /* Q4_0's: exactly -8 x the scale */
        for (int a = 0; a < N; a++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[a], ones));
            acc[a] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws, _mm256_set1_ps(xd[a * blocks + b])), acc[a]);
            acc[a] = _mm256_fmadd_ps(wo, _mm256_set1_ps(xs[a * blocks + b]), acc[a]);
        }
    }
    for (int a = 0; a < N; a++) put8(y, a * out, acc[a]);
}

/* One panel's part of a panel kernel: pack panel p (its width of output rows from w) into
 * packed/ps/po and multiply activation rows a0..a1-1 against it into y. */
typedef void (*panel_rows_fn)(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t p,
                              int64_t blocks, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
                              int64_t a0, int64_t a1, float *y, int64_t out, uint8_t *packed, void *ps, void *po);

/* The panel kernels' driver: panels of `width` output rows split among the threads, each
 * packed once per pass over ACT_BYTES of activations in tiles of `mr` rows; a thread without
 * memory for a panel runs the row kernel instead. */
static void gemm_q4_panels(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out,
                           int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y,
                           int threads, int64_t width, int64_t mr, panel_rows_fn panel_rows) {
    const int64_t blocks = cols / BLOCK, panels = out / width;
    int64_t step = ACT_BYTES / cols / mr * mr;
    if (step < mr) step = mr;
    #pragma omp parallel num_threads(threads)
    {
        /* aligned_alloc takes whole multiples of the alignment */
        const size_t wbytes = (size_t)blocks * width * BLOCK / 2;
        const size_t fbytes = ((size_t)blocks * width * sizeof(float) + 63) / 64 * 64;
        uint8_t *packed = aligned_alloc(64, wbytes);
        float *ps = aligned_alloc(64, fbytes), *po = aligned_alloc(64, fbytes);
        for (int64_t a0 = 0; a0 < rows; a0 += step) {
            const int64_t a1 = a0 + step < rows ? a0 + step : rows;
            #pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < panels; p++) {
                if (!packed || !ps || !po) {  /* no memory for a panel: the row kernel, its numbers */
                    for (int64_t r = p * width; r < (p + 1) * width; r += 8)
                        for (int64_t a = a0; a < a1; a += TILE)
                            q4_rows8(w, scales, offsets, r, out, blocks, xq + a * cols, xd + a * blocks,
                                     xs + a * blocks, a1 - a < TILE ? (int)(a1 - a) : TILE, y + a * out);
                    continue;
                }
                panel_rows(w, scales, offsets, p, blocks, cols, xq, xd, xs, a0, a1, y, out, packed, ps, po);
            }
        }
        free(packed);
        free(ps);
        free(po);
    }
}

/* Activation rows a0..a1-1 against one packed panel (ps, po: its float16 scales and offsets;
 * step: pack_panel's) into y (the panel's first output column), MR rows a tile. */
static void panel_tiles(const uint8_t *packed, const uint16_t *ps, const uint16_t *po, int step, int64_t blocks,
                        int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t a0, int64_t a1,
                        dest y, int64_t out) {
    int64_t a = a0;
    for (; a + MR <= a1; a += MR)
        panel_tile(packed, ps, po, step, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks, cols,
                   dest_at(y, a * out), out, MR);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks, *sa = xs + a * blocks;
    const dest ya = dest_at(y, a * out);
#define ROWS(n) panel_tile(packed, ps, po, step, blocks, xa, da, sa, cols, ya, out, n)
    LAST_ROWS_OF_4(a1 - a, ROWS);
#undef ROWS
}

static void panel_rows(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t p, int64_t blocks,
                       int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t a0, int64_t a1,
                       float *y, int64_t out, uint8_t *packed, void *ps, void *po) {
    pack_panel(w, scales, offsets, p * PANEL, blocks, packed, ps, po, 1);
    panel_tiles(packed, ps, po, 1, blocks, cols, xq, xd, xs, a0, a1, (dest){y + p * PANEL, 0}, out);
}

/* y [rows, out] float32 = x @ w.T for int4 weights (layout as kvc_gemm_q4), out a multiple
 * of 8: every output is its blocks' scaled dot products summed in block order, whatever
 * the number of rows, so a prompt's chunks do not change its numbers. */
void kvc_gemm_q4_panels(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out,
                        int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y,
                        int threads) {
    gemm_q4_panels(w, scales, offsets, out, cols, xq, xd, xs, rows, y, threads, PANEL, MR, panel_rows);
}

/* The same products on CPUs with AVX-512 VNNI, 16 output rows a panel: one 64-byte load holds
 * 4 inputs of each of 16 rows, and an 8-bit dot product instruction multiplies and sums 4
 * pairs per lane into 32 bits, where AVX2 takes two instructions per 2 pairs. Each block's dot
 * product is the same exact integer, and the float operations per output are kvc_gemm_q4_panels'
 * in the same order: its results to the bit. Built for these CPUs only by target attributes;
 * called where the CPU lists the flags (native/__init__.py). */
#define PANEL16 16
#define MR16 8

/* 16 rows of 16 float16 values (row j at src + j * stride) as floats, transposed: dst[c * 16 + j].
 * Pairs of rows interleaved by 32 bits, then fours by 64 bits, then 128-bit lanes by shuffles. */
static inline AVX512 void transpose16(const uint16_t *src, int64_t stride, float *dst) {
    __m512 r[16], t[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + j * stride)));
    for (int i = 0; i < 16; i += 2) {  /* per 128-bit lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1], and [2], [3] */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 4; g++) {  /* u[4g + e]: in lane k, rows 4g..4g+3 at column 4k + e */
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
        r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int e = 0; e < 4; e++) {  /* column 4k + e: lane k of each group's u[4g + e] */
        const __m512 v0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x44), v1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xEE);
        _mm512_storeu_ps(dst + (0 + e) * 16, _mm512_shuffle_f32x4(v0, v2, 0x88));
        _mm512_storeu_ps(dst + (4 + e) * 16, _mm512_shuffle_f32x4(v0, v2, 0xDD));
        _mm512_storeu_ps(dst + (8 + e) * 16, _mm512_shuffle_f32x4(v1, v3, 0x88));
        _mm512_storeu_ps(dst + (12 + e) * 16, _mm512_shuffle_f32x4(v1, v3, 0xDD));
    }
}

/* Panel p's blocks: for block b, chunk c of rows 0..15 (4 bytes each), 64 bytes at b * 256 + 64c. */
static AVX512 void pack_panel16(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t r0,
                                int64_t blocks, uint8_t *packed, float *ps, float *po) {
    const int64_t stride = blocks * (BLOCK / 2);
    for (int64_t b = 0; b < blocks; b++) {
        for (int quad = 0; quad < 4; quad++) {  /* a 4x4 transpose of dwords per 4 rows */
            const uint8_t *src = w + (r0 + 4 * quad) * stride + b * (BLOCK / 2);
            const __m128i r0v = _mm_loadu_si128((const __m128i *)src), r1 = _mm_loadu_si128((const __m128i *)(src + stride));
            const __m128i r2 = _mm_loadu_si128((const __m128i *)(src + 2 * stride));
            const __m128i r3 = _mm_loadu_si128((const __m128i *)(src + 3 * stride));
            const __m128i t0 = _mm_unpacklo_epi32(r0v, r1), t1 = _mm_unpacklo_epi32(r2, r3);
            const __m128i t2 = _mm_unpackhi_epi32(r0v, r1), t3 = _mm_unpackhi_epi32(r2, r3);
            uint8_t *dst = packed + b * (PANEL16 * BLOCK / 2) + quad * 16;
            _mm_storeu_si128((__m128i *)(dst + 0), _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(dst + 64), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(dst + 128), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)(dst + 192), _mm_unpackhi_epi64(t2, t3));
        }
    }
    int64_t b = 0;
    for (; b + 16 <= blocks; b += 16) {
        transpose16(scales + r0 * blocks + b, blocks, ps + b * PANEL16);
        transpose16(offsets + r0 * blocks + b, blocks, po + b * PANEL16);
    }
    for (; b < blocks; b++)
        for (int j = 0; j < PANEL16; j++) {
            ps[b * PANEL16 + j] = _cvtsh_ss(scales[(r0 + j) * blocks + b]);
            po[b * PANEL16 + j] = _cvtsh_ss(offsets[(r0 + j) * blocks + b]);
        }
}

/* sum[a] += the 8-bit products of chunk c of block b (raw: 4 inputs of each of 16 rows, low
 * nibbles inputs 4c..4c+3 of the activations' reordered block, high nibbles 16 + 4c..) with
 * activation rows a < N, 4 pairs a lane in one instruction. */
static inline AVX512 __attribute__((always_inline)) void dot16_chunk(__m512i raw, const int8_t *xq, int64_t cols,
                                                                    int64_t b, int c, __m512i *sum, const int N) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    for (int a = 0; a < N; a++) {
        const int8_t *xb = xq + a * cols + b * BLOCK;
        int32_t four_lo, four_hi;
        memcpy(&four_lo, xb + 4 * c, 4);
        memcpy(&four_hi, xb + 16 + 4 * c, 4);
        sum[a] = _mm512_dpbusd_epi32(sum[a], lo, _mm512_set1_epi32(four_lo));
        sum[a] = _mm512_dpbusd_epi32(sum[a], hi, _mm512_set1_epi32(four_hi));
    }
}

static inline AVX512 __attribute__((always_inline)) void panel16_tile(
        const uint8_t *packed, const float *ps, const float *po, int64_t blocks, const int8_t *xq,
        const float *xd, const float *xs, int64_t cols, float *y, int64_t out, const int N) {
    __m512 acc[MR16];
    for (int a = 0; a < N; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[MR16];
        for (int a = 0; a < N; a++) sum[a] = _mm512_setzero_si512();
        const uint8_t *pb = packed + b * (PANEL16 * BLOCK / 2);
        for (int c = 0; c < 4; c++) dot16_chunk(_mm512_load_si512((const void *)(pb + 64 * c)), xq, cols, b, c, sum, N);
        const __m512 ws = _mm512_load_ps(ps + b * PANEL16), wo = _mm512_load_ps(po + b * PANEL16);
        for (int a = 0; a < N; a++) {
            const __m512 dot = _mm512_cvtepi32_ps(sum[a]);
            acc[a] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws, _mm512_set1_ps(xd[a * blocks + b])), acc[a]);
            acc[a] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xs[a * blocks + b]), acc[a]);
        }
    }
    for (int a = 0; a < N; a++) _mm512_storeu_ps(y + a * out, acc[a]);
}

static AVX512 void panel16_rows(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t p,
                                int64_t blocks, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
                                int64_t a0, int64_t a1, float *y, int64_t out, uint8_t *packed, void *vps, void *vpo) {
    float *ps = vps, *po = vpo;
    pack_panel16(w, scales, offsets, p * PANEL16, blocks, packed, ps, po);
    int64_t a = a0;
    for (; a + MR16 <= a1; a += MR16)
        panel16_tile(packed, ps, po, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks, cols,
                     y + a * out + p * PANEL16, out, MR16);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks, *sa = xs + a * blocks;
    float *ya = y + a * out + p * PANEL16;
#define ROWS(n) panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, n)
    LAST_ROWS_OF_8(a1 - a, ROWS);
#undef ROWS
}

/* As kvc_gemm_q4_panels, out a multiple of 16, on a CPU with AVX-512 VNNI. */
void kvc_gemm_q4_panels16(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out,
                          int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y,
                          int threads) {
    gemm_q4_panels(w, scales, offsets, out, cols, xq, xd, xs, rows, y, threads, PANEL16, MR16, panel16_rows);
}

/* Rows start..end of an int4 weight into dst [end - start, cols]: float32, or bfloat16
 * (uint16) where bf16 is set, for a bf16 model on a CPU whose bf16 matmul is the fast one. */
void kvc_dequantize_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t start,
                       int64_t end, int64_t cols, void *dst, int bf16, int threads) {
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for schedule(static, 16) num_threads(threads)
    for (int64_t r = start; r < end; r++) {
        const uint8_t *wr = w + r * (cols / 2);
        for (int64_t b = 0; b < blocks; b++) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(wr + b * (BLOCK / 2)));
            const __m128i lo = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
            const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
            const __m256 s = _mm256_set1_ps(_cvtsh_ss(scales[r * blocks + b]));
            const __m256 o = _mm256_set1_ps(_cvtsh_ss(offsets[r * blocks + b]));
            const __m256 v[4] = {
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first)), s, o),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8))), s, o),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second)), s, o),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8))), s, o),
            };
            const int64_t at = (r - start) * cols + b * BLOCK;
            for (int k = 0; k < 4; k += 2) {
                if (bf16) put16(round_bf16(v[k]), round_bf16(v[k + 1]), dst, at + 8 * k, 1);
                else put16(v[k], v[k + 1], dst, at + 8 * k, 0);
            }
        }
    }
}

/* ---- Weights kept in the panel layout ------------------------------------------------------
 * Where the 8-row panels are a CPU's prefill kernel, its int4 weights are packed once, at
 * load (kvc_pack_q4): each 8 output rows' nibbles, scales and offsets become the panel
 * pack_panel makes, in the place of the same rows (so the tensors keep their shapes; where every
 * offset is -8 x its scale, as a Q4_0 source's are, none is kept: po NULL, or an expert's or a
 * linear's offsets address 0, and the kernels derive them to the same bits). Every step then
 * multiplies panels as they lie: a decode step's row needs no horizontal sums per
 * block (the row kernel's cost on CPUs without AVX-512), and a prefill packs nothing. A
 * panel's products are the row kernel's to the bit (panel_tile's order is q4_rows8's).
 * Where two panels are multiplied at once (q4_panel_step() 2: pair_tile), panels 2k and 2k + 1
 * lie interleaved, block by block (kept_panel_at): one stream, not two, which keeps more of it in
 * flight from RAM. Packing and multiplying run in one process, so they agree on the layout. */

/* Where panel p (of `panels`) of a weight kept as panels lies, and its blocks' step. */
typedef struct { uint8_t *w; uint16_t *s, *o; int step; } kept_panel;

static inline kept_panel kept_panel_at(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t p,
                                       int64_t panels, int64_t blocks) {
    int step;
    const int64_t at = kept_panel_offset(p, panels, blocks, &step);
    return (kept_panel){(uint8_t *)pw + at * (BLOCK / 2), (uint16_t *)ps + at, po ? (uint16_t *)po + at : NULL, step};
}

void kvc_pack_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols,
                 uint8_t *pw, uint16_t *ps, uint16_t *po, int threads) {
    const int64_t blocks = cols / BLOCK, panels = out / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const kept_panel k = kept_panel_at(pw, ps, po, p, panels, blocks);
        pack_panel(w, scales, offsets, p * PANEL, blocks, k.w, k.s, k.o, k.step);
    }
}

/* The row layout back from the panel layout (a dense fallback's dequantization reads rows). */
void kvc_unpack_q4(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t out, int64_t cols, uint8_t *w,
                   uint16_t *scales, uint16_t *offsets, int threads) {
    const int64_t blocks = cols / BLOCK, panels = out / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const kept_panel k = kept_panel_at(pw, ps, po, p, panels, blocks);
        unpack_panel_nibbles(k.w, k.step, p * PANEL, blocks, w);
        for (int64_t b = 0; b < blocks; b++)
            for (int j = 0; j < PANEL; j++) {
                const uint16_t sc = k.s[b * k.step * PANEL + j];
                scales[(p * PANEL + j) * blocks + b] = sc;
                offsets[(p * PANEL + j) * blocks + b] = k.o ? k.o[b * k.step * PANEL + j]
                                                            : _cvtss_sh(-8.0f * _cvtsh_ss(sc), 0);
            }
    }
}

/* Panel p (of `panels`) of a weight in the panel layout against activation rows a0..a1-1. */
static inline void packed_panel_rows(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t p,
                                     int64_t panels, int64_t blocks, int64_t cols, const int8_t *xq, const float *xd,
                                     const float *xs, int64_t a0, int64_t a1, dest y, int64_t out) {
    const kept_panel k = kept_panel_at(pw, ps, po, p, panels, blocks);
    panel_tiles(k.w, k.s, k.o, k.step, blocks, cols, xq, xd, xs, a0, a1, dest_at(y, p * PANEL), out);
}

/* The two panels of a pair at once on CPUs with AVX-512's 8-bit dot product: chunk c of both in
 * one 64-byte vector (lanes 0-7: the first panel's rows, 8-15: the second's, which follows it in
 * each block), so one instruction multiplies and sums 4 pairs for 16 rows where panel_tile takes
 * two per 2 pairs for 8. A block's products are panel_tile's exact integers and each output's float
 * operations its own, in its order: its bits, at every row count. */
#define MR2 8
/* Bytes ahead in the pair's stream that a pass asks for, and in its scales' and offsets' (a
 * line per 2 blocks) (docs/performance.md). */
#define PAIR_PREFETCH 4096

static inline AVX512 __attribute__((always_inline)) void pair_tile(
        const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t blocks, const int8_t *xq,
        const float *xd, const float *xs, int64_t cols, dest y, int64_t out, const int N) {
    __m512 acc[MR2 + 1];
    for (int a = 0; a < N; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[MR2 + 1];
        for (int a = 0; a < N; a++) sum[a] = _mm512_setzero_si512();
        const uint8_t *w = pw + b * (2 * PANEL * BLOCK / 2);  /* the first panel's 128 bytes, then the second's */
        const uint16_t *s = ps + b * 2 * PANEL, *o = po ? po + b * 2 * PANEL : NULL;
        for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(w + PAIR_PREFETCH + 64 * line), _MM_HINT_T0);
        if ((b & 1) == 0) {  /* scales and offsets: 32 bytes a block, a line per 2 */
            _mm_prefetch((const char *)(s + PAIR_PREFETCH / 8), _MM_HINT_T0);
            if (o) _mm_prefetch((const char *)(o + PAIR_PREFETCH / 8), _MM_HINT_T0);
        }
        for (int c = 0; c < 4; c++) {  /* chunk c of both panels */
            const __m256i first = _mm256_load_si256((const __m256i *)(w + 32 * c));
            dot16_chunk(_mm512_inserti64x4(_mm512_castsi256_si512(first),
                                           _mm256_load_si256((const __m256i *)(w + PANEL * BLOCK / 2 + 32 * c)), 1),
                        xq, cols, b, c, sum, N);
        }
        const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
        const __m512 wo = o ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o))
                            : _mm512_mul_ps(ws, _mm512_set1_ps(-8.0f));
        for (int a = 0; a < N; a++) {
            const __m512 dot = _mm512_cvtepi32_ps(sum[a]);
            acc[a] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws, _mm512_set1_ps(xd[a * blocks + b])), acc[a]);
            acc[a] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xs[a * blocks + b]), acc[a]);
        }
    }
    for (int a = 0; a < N; a++) put16_wide(y, a * out, acc[a]);
}

/* Panels p and p + 1 (a pair, kept interleaved) of a weight in the panel layout against
 * activation rows a0..a1-1. */
static AVX512 void pair_rows(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t p, int64_t panels,
                             int64_t blocks, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
                             int64_t a0, int64_t a1, dest y, int64_t out) {
    const kept_panel k = kept_panel_at(pw, ps, po, p, panels, blocks);
    int64_t a = a0;
    for (; a + MR2 <= a1 && a1 - a != MR2 + 1; a += MR2)
        pair_tile(k.w, k.s, k.o, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks, cols,
                  dest_at(y, a * out + p * PANEL), out, MR2);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks, *xsa = xs + a * blocks;
    const dest ya = dest_at(y, a * out + p * PANEL);
#define ROWS(n) pair_tile(k.w, k.s, k.o, blocks, xa, da, xsa, cols, ya, out, n)
    if (a1 - a == MR2 + 1)
        ROWS(MR2 + 1);  /* a verified draft of 8: one pass (a second for one row costs more than a decode) */
    else
        LAST_ROWS_OF_8(a1 - a, ROWS);
#undef ROWS
}

int q4_panel_step(void) {
    return avx512_cpu() ? 2 : 1;
}

/* The unit of a weight kept as panels that starts at panel p (of `panels`): q4_panel_step()
 * panels, fewer at the end. */
static inline void packed_unit_rows(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t p,
                                    int64_t panels, int64_t blocks, int64_t cols, const int8_t *xq, const float *xd,
                                    const float *xs, int64_t a0, int64_t a1, dest y, int64_t out) {
    if (unit_is_pair(p, panels))
        pair_rows(pw, ps, po, p, panels, blocks, cols, xq, xd, xs, a0, a1, y, out);
    else
        packed_panel_rows(pw, ps, po, p, panels, blocks, cols, xq, xd, xs, a0, a1, y, out);
}

/* The pair of a weight kept as panels that starts at panel p, for the AMX tiles; y: the weight's
 * output of the first activation row. */
static inline amx_pair pair_for_tiles(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t p,
                                      int64_t panels, int64_t blocks, dest y, int64_t out) {
    const kept_panel k = kept_panel_at(pw, ps, po, p, panels, blocks);
    return (amx_pair){k.w, k.s, k.o, dest_at(y, p * PANEL), out};
}

/* Units of `step` kept panels a thread takes at a time for `rows` activation rows: a decode
 * step's ROW_GROUPS groups of 8 rows, half as many for a verification's 8-15 rows (taken one
 * at a time, each fetch of the shared counter moves its line between the cores, and a unit of so
 * few rows is short); a prefill's units (panels x every row) are long, and one at a time
 * keeps the threads even, or AMX_GROUP pairs where they run on AMX tiles (each tile of
 * activations then serves them all while it is in the cache). */
static inline int packed_units_at_a_time(int64_t rows, int64_t step, const amx_acts *acts) {
    if (rows < 2 * PANEL) return (int)(ROW_GROUPS / step / (rows < PANEL ? 1 : 2));
    return acts->tiles ? AMX_GROUP : 1;
}

/* kvc_gemm_q4 for a weight in the panel layout (out a multiple of 8), at any row count: the
 * activations in passes of ACT_BYTES, as the packing panel kernel takes them. y: float32, or
 * bfloat16 where y_bf16 (each output rounded as torch rounds the float32 one). */
typedef struct {
    const uint8_t *pw; const uint16_t *ps, *po; int64_t out, cols; const int8_t *xq; const float *xd, *xs;
    int64_t a0, a1; dest y; const amx_acts *acts;
} q4p_call;

/* Units u0..u1-1 (at most AMX_GROUP) of the call: their pairs' rows on AMX tiles where the
 * activations were packed for them, then every unit's rows left by the panel kernels. */
static void q4p_units(const q4p_call *c, int64_t u0, int64_t u1) {
    const int64_t blocks = c->cols / BLOCK, panels = c->out / PANEL, unit = q4_panel_step();
    int64_t tiled = 0;  /* rows of the pairs done on AMX tiles */
    if (c->acts->tiles) {
        amx_pair pairs[AMX_GROUP];
        int n = 0;
        for (int64_t u = u0; u < u1; u++)
            if (unit_is_pair(u * unit, panels))
                pairs[n++] = pair_for_tiles(c->pw, c->ps, c->po, u * unit, panels, blocks, dest_at(c->y, c->a0 * c->out),
                                            c->out);
        tiled = q4_pairs_amx(pairs, n, blocks, c->acts);
    }
    for (int64_t u = u0; u < u1; u++)
        packed_unit_rows(c->pw, c->ps, c->po, u * unit, panels, blocks, c->cols, c->xq, c->xd, c->xs,
                         c->a0 + (unit_is_pair(u * unit, panels) ? tiled : 0), c->a1, c->y, c->out);
}

static void gemm_q4p_units(void *ctx, int64_t u0, int64_t u1, int thread) {
    (void)thread;
    for (int64_t u = u0; u < u1; u += AMX_GROUP) q4p_units(ctx, u, u + AMX_GROUP < u1 ? u + AMX_GROUP : u1);
}

void kvc_gemm_q4p(const uint8_t *pw, const uint16_t *ps, const uint16_t *po, int64_t out, int64_t cols,
                  const int8_t *xq, const float *xd, const float *xs, int64_t rows, void *y, int y_bf16,
                  int threads) {
    const int64_t panels = out / PANEL, unit = q4_panel_step();
    int64_t step = ACT_BYTES / cols / MR * MR;
    if (step < MR) step = MR;
    const int64_t blocks = cols / BLOCK;
    for (int64_t a0 = 0; a0 < rows; a0 += step) {
        const int64_t a1 = a0 + step < rows ? a0 + step : rows;
        amx_acts acts;
        amx_pack(xq + a0 * cols, xd + a0 * blocks, xs + a0 * blocks, a1 - a0, cols, &acts, threads);
        q4p_call c = {pw, ps, po, out, cols, xq, xd, xs, a0, a1, {y, y_bf16}, &acts};
        pool_for(threads, (panels + unit - 1) / unit, packed_units_at_a_time(c.a1 - a0, unit, &acts), gemm_q4p_units,
                 &c);
    }
}

/* Linears that take the same activations (a layer's q/k/v, gate/up), all in one loop
 * over activations quantized once: weight i (w[i], scales[i], offsets[i], laid out as
 * kvc_gemm_q4's, or kept as panels) of outs[i] rows into ys[i] [rows, outs[i]], each output by
 * kvc_gemm_q4's arithmetic. A decode step then wakes the threads once for them, not once a
 * linear; weights kept as panels take any step this way. */
typedef struct {
    const int64_t *w, *scales, *offsets, *outs, *ys; const moe_unit *units; int64_t cols; const int8_t *xq;
    const float *xd, *xs; int64_t rows; int panels, y_bf16; const amx_acts *acts;
} q4_many_call;

/* Units u0..u1-1 (at most AMX_GROUP) of the call, as q4p_units. */
static void q4_many_units(const q4_many_call *c, int64_t u0, int64_t u1) {
    const int64_t blocks = c->cols / BLOCK, cols = c->cols, rows = c->rows;
    int64_t tiled = 0;  /* rows of the pairs done on AMX tiles */
    if (c->acts->tiles) {
        amx_pair pairs[AMX_GROUP];
        int n = 0;
        for (int64_t u = u0; u < u1; u++) {
            const int64_t i = c->units[u].e, out = c->outs[i];
            if (unit_is_pair(c->units[u].g, out / PANEL))
                pairs[n++] = pair_for_tiles((const uint8_t *)c->w[i], (const uint16_t *)c->scales[i],
                                            (const uint16_t *)c->offsets[i], c->units[u].g, out / PANEL, blocks,
                                            (dest){(void *)c->ys[i], c->y_bf16}, out);
        }
        tiled = q4_pairs_amx(pairs, n, blocks, c->acts);
    }
    for (int64_t u = u0; u < u1; u++) {
        const int64_t i = c->units[u].e, out = c->outs[i];
        const uint8_t *wi = (const uint8_t *)c->w[i];
        const uint16_t *si = (const uint16_t *)c->scales[i], *oi = (const uint16_t *)c->offsets[i];
        if (c->panels) {
            packed_unit_rows(wi, si, oi, c->units[u].g, out / PANEL, blocks, cols, c->xq, c->xd, c->xs,
                             unit_is_pair(c->units[u].g, out / PANEL) ? tiled : 0, rows,
                             (dest){(void *)c->ys[i], c->y_bf16}, out);
            continue;
        }
        for (int64_t a0 = 0; a0 < rows; a0 += TILE)
            q4_rows8(wi, si, oi, c->units[u].g * 8, out, blocks, c->xq + a0 * cols, c->xd + a0 * blocks,
                     c->xs + a0 * blocks, rows - a0 < TILE ? (int)(rows - a0) : TILE, (float *)c->ys[i] + a0 * out);
    }
}

static void gemm_q4_many_units(void *ctx, int64_t u0, int64_t u1, int thread) {
    (void)thread;
    for (int64_t u = u0; u < u1; u += AMX_GROUP) q4_many_units(ctx, u, u + AMX_GROUP < u1 ? u + AMX_GROUP : u1);
}

static int gemm_q4_many(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *outs,
                        const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd,
                        const float *xs, int64_t rows, int threads, int panels, int y_bf16) {
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++)
        if (outs[i] <= 0 || (panels && outs[i] % PANEL)) return -2;
    const int64_t step = panels ? q4_panel_step() : 1;
    moe_unit *units = linear_units(outs, count, step, &n);
    if (!units) return -1;
    amx_acts acts = {NULL, NULL, NULL, 0};
    if (panels) amx_pack(xq, xd, xs, rows, cols, &acts, threads);
    q4_many_call c = {w, scales, offsets, outs, ys, units, cols, xq, xd, xs, rows, panels, y_bf16, &acts};
    pool_for(threads, n, panels ? packed_units_at_a_time(rows, step, &acts) : ROW_GROUPS, gemm_q4_many_units, &c);
    free(units);
    return 0;
}

int kvc_gemm_q4_many(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *outs,
                     const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd,
                     const float *xs, int64_t rows, int threads) {
    return gemm_q4_many(w, scales, offsets, outs, ys, count, cols, xq, xd, xs, rows, threads, 0, 0);
}

/* kvc_gemm_q4_many for weights kept as panels (each outs[i] a multiple of 8); ys bfloat16 where
 * y_bf16, as kvc_gemm_q4p's. */
int kvc_gemm_q4p_many(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *outs,
                      const int64_t *ys, int64_t count, int64_t cols, const int8_t *xq, const float *xd,
                      const float *xs, int64_t rows, int y_bf16, int threads) {
    return gemm_q4_many(w, scales, offsets, outs, ys, count, cols, xq, xd, xs, rows, threads, 1, y_bf16);
}

/* ---- Routed experts of int4 weights ---------------------------------------------------- */

/* A thread's scratch for one packed panel (experts in the row layout with a panel's worth of
 * slots), in one allocation kept in *slot from its first use; NULLs where there was no memory
 * (the row kernel runs). */
typedef struct { uint8_t *packed; float *ps, *po; } panel_scratch;

static panel_scratch panel_scratch_of(void **slot, int64_t blocks) {
    const size_t wbytes = (size_t)blocks * PANEL * BLOCK / 2;
    const size_t fbytes = ((size_t)blocks * PANEL * sizeof(float) + 63) / 64 * 64;
    if (!*slot) *slot = aligned_alloc(64, wbytes + 2 * fbytes);  /* wbytes: a multiple of 64 */
    uint8_t *base = *slot;
    if (!base) return (panel_scratch){NULL, NULL, NULL};
    return (panel_scratch){base, (float *)(base + wbytes), (float *)(base + wbytes + fbytes)};
}

/* One unit of routed-expert work: the expert's output rows g * 8 .. g * 8 + 7 for its slots
 * a0..a1-1 into y [slots, out]. Kept as panels: multiplied as they lie; in the row layout, a
 * panel packed for a panel's worth of slots (kvc_gemm_q4_panels' threshold), else the row
 * kernel. Every path gives a slot its expert's linear's bits. */
static inline void moe_q4_unit(const uint8_t *we, const uint16_t *se, const uint16_t *oe, int64_t g, int64_t out,
                               int64_t blocks, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
                               int64_t a0, int64_t a1, float *y, int panels, panel_scratch scratch) {
    if (panels) {
        packed_unit_rows(we, se, oe, g, out / PANEL, blocks, cols, xq, xd, xs, a0, a1, (dest){y, 0}, out);
        return;
    }
    if (a1 - a0 >= PANEL && scratch.packed && scratch.ps && scratch.po) {
        panel_rows(we, se, oe, g, blocks, cols, xq, xd, xs, a0, a1, y, out, scratch.packed, scratch.ps, scratch.po);
        return;
    }
    for (int64_t a = a0; a < a1; a += TILE)
        q4_rows8(we, se, oe, g * 8, out, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks,
                 a1 - a < TILE ? (int)(a1 - a) : TILE, y + a * out);
}

/* moe_project for int4 experts (p->panels: kept as panels); a panel packed in the thread's
 * scratch where an expert in the row layout has a panel's worth of slots. */
void moe_q4_project(const moe_proj *p, const moe_unit *units, int64_t u0, int64_t u1, const int64_t *starts,
                    int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs, float *y,
                    void **scratch) {
    const int64_t blocks = cols / BLOCK;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t e = units[u].e, a0 = starts[e], a1 = starts[e + 1];
        const int packs = !p->panels && out % PANEL == 0 && a1 - a0 >= PANEL;
        moe_q4_unit((const uint8_t *)p->w[e], (const uint16_t *)p->s[e], (const uint16_t *)p->o[e], units[u].g, out,
                    blocks, cols, xq, xd, xs, a0, a1, y, p->panels,
                    packs ? panel_scratch_of(scratch, blocks) : (panel_scratch){NULL, NULL, NULL});
    }
}

int kvc_moe_q4(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *starts,
               int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
               float *y, int threads) {
    const moe_proj p = {w, scales, offsets, 0};
    return moe_matmul(moe_q4_project, &p, starts, experts, out, cols, xq, xd, xs, y, threads);
}

/* kvc_moe_q4 for experts in the panel layout (out a multiple of 8). */
int kvc_moe_q4p(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *starts,
                int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
                float *y, int threads) {
    if (out % PANEL) return -2;
    const moe_proj p = {w, scales, offsets, 1};
    return moe_matmul(moe_q4_project, &p, starts, experts, out, cols, xq, xd, xs, y, threads);
}
