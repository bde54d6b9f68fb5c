/* kvcellar's CPU kernels for quantized linears (x86-64 with AVX2, FMA and F16C), built by
 * engine/native/__init__.py: decode-sized steps read each weight row as it lies, prefill-
 * sized ones of int4 weights multiply panels of 8 rows (kvc_gemm_q4_panels; of 16 rows with
 * AVX-512's 8-bit dot product, kvc_gemm_q4_panels16). Activations
 * are quantized to 8 bits per block of 32 inputs (d = max|x| / 127, q = round(x / d)) and multiplied with the weights'
 * integers in 8-bit dot products, the scheme of llama.cpp's Q4_1 x Q8_1: a step reads the
 * 4-bit weights once at close to memory speed, where torch's int4 kernel converts every
 * weight to float first.
 *
 * Weight layouts are kvcellar.quantization's:
 *   int4: nibbles uint8 [out, in / 2] (input 2j in the low nibble of byte j), per group of 32
 *         inputs a scale and an offset (float16 here): w = q * scale + offset, q in 0..15;
 *   int8: int8 [out, in], a float32 scale per output: w = q * scale;
 *   mxfp4: nibbles as int4's, each an E2M1 code, an E8M0 exponent byte per group of 32.
 * Inside a block of 32 the quantized activations hold the even inputs first, then the odd
 * ones, the order in which a block's 16 bytes of nibbles unpack. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
/* Rows of activations multiplied per pass over a weight row: enough accumulators to reuse
 * each loaded weight block, few enough to stay in the 16 vector registers. */
#define TILE 4
/* Bytes of weights ahead that a pass asks the cache for: the hardware prefetcher alone kept
 * a thread's stream well below the memory's speed (docs/performance.md). */
#define PREFETCH 2048

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

/* A block's 16 bytes of nibbles as 32 bytes: low nibbles (even inputs) in the lower half,
 * high nibbles in the upper. */
static inline __m256 q4_block(const uint8_t *wb) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)wb));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                                _mm256_set1_epi8(0x0F)));
}

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

/* 8 rows of 8 floats transposed in place: r[k] lane j <- r[j] lane k. */
static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
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
    const int m = out - r0 < 8 ? (int)(out - r0) : 8;
    for (int a = 0; a < n; a++) {
        if (m == 8) {
            _mm256_storeu_ps(y + a * out + r0, acc[a]);
        } else {
            float part[8];
            _mm256_storeu_ps(part, acc[a]);
            memcpy(y + a * out + r0, part, m * sizeof(float));
        }
    }
}

/* y [rows, out] float32 = x @ w.T for int4 weights: 8 output rows at a time, TILE activation
 * rows at a time against them. */
void kvc_gemm_q4(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out, int64_t cols,
                 const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y, int threads) {
    const int64_t blocks = cols / BLOCK, groups = (out + 7) / 8;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t a0 = 0; a0 < rows; a0 += TILE) {
            const int n = rows - a0 < TILE ? (int)(rows - a0) : TILE;
            q4_rows8(w, scales, offsets, g * 8, out, blocks, xq + a0 * cols, xd + a0 * blocks, xs + a0 * blocks, n,
                     y + a0 * out);
        }
    }
}

/* Prefill-sized steps of int4 weights: 8 output rows at a time against MR activation rows,
 * the 8 rows' nibbles first interleaved (a "panel") so that one 32-byte load holds 4 inputs
 * of each row, and each vector lane accumulates one output. The 8-bit products of a block
 * are summed in 16 bits (8 x 2 x 15 x 127 < 2^15: exact) and scaled once a block, so a block
 * costs 8 multiply-adds of 32 pairs where kvc_gemm_q4 spends a float conversion and a lane
 * permute per 8 inputs. */
#define PANEL 8
#define MR 4
/* Bytes of activations multiplied per pass over the panels: an L3's worth, so that each
 * panel is packed once for them (a pass per L2's worth repacked the weights dozens of times
 * for wide inputs). */
#define ACT_BYTES (8 * 1024 * 1024)

/* Panel p's blocks: for block b, chunk c (bytes 4c..4c+3 of each row's 16) of rows 0..7,
 * 32 bytes; scales and offsets as floats, 8 a block. */
static void pack_panel(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t r0,
                       int64_t blocks, uint8_t *packed, float *ps, float *po) {
    const int64_t stride = blocks * (BLOCK / 2);
    for (int64_t b = 0; b < blocks; b++) {
        __m128i row[PANEL];
        for (int j = 0; j < PANEL; j++) row[j] = _mm_loadu_si128((const __m128i *)(w + (r0 + j) * stride + b * (BLOCK / 2)));
        /* a 4x4 transpose of dwords for rows 0-3 and for rows 4-7 */
        for (int half = 0; half < 2; half++) {
            const __m128i *r = row + 4 * half;
            const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpacklo_epi32(r[2], r[3]);
            const __m128i t2 = _mm_unpackhi_epi32(r[0], r[1]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
            uint8_t *dst = packed + b * (PANEL * BLOCK / 2) + half * 16;
            _mm_storeu_si128((__m128i *)(dst + 0), _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(dst + 32), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(dst + 64), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)(dst + 96), _mm_unpackhi_epi64(t2, t3));
        }
        for (int j = 0; j < PANEL; j++) {
            ps[b * PANEL + j] = _cvtsh_ss(scales[(r0 + j) * blocks + b]);
            po[b * PANEL + j] = _cvtsh_ss(offsets[(r0 + j) * blocks + b]);
        }
    }
}

/* N activation rows (N <= MR, a constant at each call site) against one packed panel:
 * y[a * out + 0..7]. Chunk c's low nibbles are inputs 4c..4c+3 of the activations'
 * reordered block, its high nibbles inputs 16 + 4c.. */
static inline __attribute__((always_inline)) void panel_tile(
        const uint8_t *packed, const float *ps, const float *po, int64_t blocks, const int8_t *xq,
        const float *xd, const float *xs, int64_t cols, float *y, int64_t out, const int N) {
    __m256 acc[MR];
    for (int a = 0; a < N; a++) acc[a] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sum[MR];
        for (int a = 0; a < N; a++) sum[a] = _mm256_setzero_si256();
        const uint8_t *pb = packed + b * (PANEL * BLOCK / 2);
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
        const __m256 ws = _mm256_load_ps(ps + b * PANEL), wo = _mm256_load_ps(po + b * PANEL);
        for (int a = 0; a < N; a++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[a], ones));
            acc[a] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws, _mm256_set1_ps(xd[a * blocks + b])), acc[a]);
            acc[a] = _mm256_fmadd_ps(wo, _mm256_set1_ps(xs[a * blocks + b]), acc[a]);
        }
    }
    for (int a = 0; a < N; a++) _mm256_storeu_ps(y + a * out, acc[a]);
}

/* One panel's part of a panel kernel: pack panel p (its width of output rows from w) into
 * packed/ps/po and multiply activation rows a0..a1-1 against it into y. */
typedef void (*panel_rows_fn)(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t p,
                              int64_t blocks, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
                              int64_t a0, int64_t a1, float *y, int64_t out, uint8_t *packed, float *ps, float *po);

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
            #pragma omp for schedule(static)
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

static void panel_rows(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t p, int64_t blocks,
                       int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t a0, int64_t a1,
                       float *y, int64_t out, uint8_t *packed, float *ps, float *po) {
    pack_panel(w, scales, offsets, p * PANEL, blocks, packed, ps, po);
    int64_t a = a0;
    for (; a + MR <= a1; a += MR)
        panel_tile(packed, ps, po, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks, cols,
                   y + a * out + p * PANEL, out, MR);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks, *sa = xs + a * blocks;
    float *ya = y + a * out + p * PANEL;
    switch (a1 - a) {  /* the last rows, each count its own constant */
        case 3: panel_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 3); break;
        case 2: panel_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 2); break;
        case 1: panel_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 1); break;
        default: break;
    }
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
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
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

static inline AVX512 __attribute__((always_inline)) void panel16_tile(
        const uint8_t *packed, const float *ps, const float *po, int64_t blocks, const int8_t *xq,
        const float *xd, const float *xs, int64_t cols, float *y, int64_t out, const int N) {
    __m512 acc[MR16];
    for (int a = 0; a < N; a++) acc[a] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[MR16];
        for (int a = 0; a < N; a++) sum[a] = _mm512_setzero_si512();
        const uint8_t *pb = packed + b * (PANEL16 * BLOCK / 2);
        for (int c = 0; c < 4; c++) {
            const __m512i raw = _mm512_load_si512((const void *)(pb + 64 * c));
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
                                int64_t a0, int64_t a1, float *y, int64_t out, uint8_t *packed, float *ps, float *po) {
    pack_panel16(w, scales, offsets, p * PANEL16, blocks, packed, ps, po);
    int64_t a = a0;
    for (; a + MR16 <= a1; a += MR16)
        panel16_tile(packed, ps, po, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks, cols,
                     y + a * out + p * PANEL16, out, MR16);
    const int8_t *xa = xq + a * cols;
    const float *da = xd + a * blocks, *sa = xs + a * blocks;
    float *ya = y + a * out + p * PANEL16;
    switch (a1 - a) {  /* the last rows, each count its own constant */
        case 7: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 7); break;
        case 6: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 6); break;
        case 5: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 5); break;
        case 4: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 4); break;
        case 3: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 3); break;
        case 2: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 2); break;
        case 1: panel16_tile(packed, ps, po, blocks, xa, da, sa, cols, ya, out, 1); break;
        default: break;
    }
}

/* As kvc_gemm_q4_panels, out a multiple of 16, on a CPU with AVX-512 VNNI. */
void kvc_gemm_q4_panels16(const uint8_t *w, const uint16_t *scales, const uint16_t *offsets, int64_t out,
                          int64_t cols, const int8_t *xq, const float *xd, const float *xs, int64_t rows, float *y,
                          int threads) {
    gemm_q4_panels(w, scales, offsets, out, cols, xq, xd, xs, rows, y, threads, PANEL16, MR16, panel16_rows);
}

/* Output r of int8 weights (row wr, its scale) against n <= TILE activation rows: signs moved
 * onto the activations, as the 8-bit dot product takes one unsigned operand. */
static inline void q8_row(const int8_t *wr, float scale, int64_t r, int64_t out, int64_t blocks, const int8_t *xq,
                          const float *xd, int n, float *y) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE];
    for (int a = 0; a < n; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* the weights in the activations' order: even inputs, then odd ones */
        _mm_prefetch((const char *)(wr + b * BLOCK + PREFETCH), _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(wr + b * BLOCK));
        const __m256i even_odd = _mm256_shuffle_epi8(raw, _mm256_setr_epi8(
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        /* lanes: [e0-7 o0-7 | e8-15 o8-15] -> [e0-15 | o0-15] */
        const __m256i wq = _mm256_permute4x64_epi64(even_odd, 0xD8);
        const __m256i wabs = _mm256_sign_epi8(wq, wq);
        for (int a = 0; a < n; a++) {
            const int64_t i = a * blocks + b;
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + i * BLOCK)), wq);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones);
            acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd[i]), acc[a]);
        }
    }
    for (int a = 0; a < n; a++) y[a * out + r] = hsum(acc[a]) * scale;
}

/* y [rows, out] float32 = x @ w.T for int8 weights. */
void kvc_gemm_q8(const int8_t *w, const float *scales, int64_t out, int64_t cols,
                 const int8_t *xq, const float *xd, int64_t rows, float *y, int threads) {
    const int64_t blocks = cols / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < out; r++)
        for (int64_t a0 = 0; a0 < rows; a0 += TILE)
            q8_row(w + r * cols, scales[r], r, out, blocks, xq + a0 * cols, xd + a0 * blocks,
                   rows - a0 < TILE ? (int)(rows - a0) : TILE, y + a0 * out);
}

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
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < out; r += MX_ROWS)
            mx_rows(w, exps, r, out - r < MX_ROWS ? (int)(out - r) : MX_ROWS, blocks, xq, xd, y);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
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

/* ---- Routed experts: all of a MoE layer's experts in one call ----------------------------
 * A step's (token, expert) slots arrive grouped by expert: activation rows starts[e] ..
 * starts[e + 1] - 1 go through expert e's weights (w[e], scales[e], offsets[e]: addresses of
 * its linear, laid out as kvc_gemm_q4's or kvc_gemm_q8's), into the same rows of y [slots, out].
 * One parallel region runs every routed expert's output rows, where one call per expert woke
 * the threads 2 x top-k times a layer for a few hundred microseconds of work each. Each output
 * is computed by the arithmetic of kvc_gemm_q4 / kvc_gemm_q8, so a slot's numbers are the same
 * to the bit as its expert's linear run alone, at any row count. */

/* A unit of work: expert e's output rows g * 8 .. g * 8 + 7 for all its slots. */
typedef struct { int64_t e, g; } moe_unit;

static moe_unit *moe_units(const int64_t *starts, int64_t experts, int64_t groups, int64_t *count) {
    int64_t n = 0;
    for (int64_t e = 0; e < experts; e++) n += starts[e + 1] > starts[e] ? groups : 0;
    moe_unit *units = malloc((size_t)(n > 0 ? n : 1) * sizeof(moe_unit));
    if (!units) return NULL;
    int64_t i = 0;
    for (int64_t e = 0; e < experts; e++)
        if (starts[e + 1] > starts[e])
            for (int64_t g = 0; g < groups; g++) units[i++] = (moe_unit){e, g};
    *count = n;
    return units;
}

/* Returns -1 where it has no memory for its work list (nothing written). */
int kvc_moe_q4(const int64_t *w, const int64_t *scales, const int64_t *offsets, const int64_t *starts,
               int64_t experts, int64_t out, int64_t cols, const int8_t *xq, const float *xd, const float *xs,
               float *y, int threads) {
    const int64_t blocks = cols / BLOCK, groups = (out + 7) / 8;
    int64_t count;
    moe_unit *units = moe_units(starts, experts, groups, &count);
    if (!units) return -1;
    #pragma omp parallel num_threads(threads)
    {
        /* A panel of one expert's 8 rows pays where the expert has a panel's worth of slots
         * (kvc_gemm_q4_panels' threshold); without memory for one the row kernel runs. */
        const size_t fbytes = ((size_t)blocks * PANEL * sizeof(float) + 63) / 64 * 64;
        uint8_t *packed = out % PANEL ? NULL : aligned_alloc(64, (size_t)blocks * PANEL * BLOCK / 2);
        float *ps = aligned_alloc(64, fbytes), *po = aligned_alloc(64, fbytes);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < count; u++) {
            const int64_t e = units[u].e, r0 = units[u].g * 8, a0 = starts[e], a1 = starts[e + 1];
            const uint8_t *we = (const uint8_t *)w[e];
            const uint16_t *se = (const uint16_t *)scales[e], *oe = (const uint16_t *)offsets[e];
            if (a1 - a0 >= PANEL && packed && ps && po) {
                panel_rows(we, se, oe, units[u].g, blocks, cols, xq, xd, xs, a0, a1, y, out, packed, ps, po);
                continue;
            }
            for (int64_t a = a0; a < a1; a += TILE)
                q4_rows8(we, se, oe, r0, out, blocks, xq + a * cols, xd + a * blocks, xs + a * blocks,
                         a1 - a < TILE ? (int)(a1 - a) : TILE, y + a * out);
        }
        free(packed);
        free(ps);
        free(po);
    }
    free(units);
    return 0;
}

int kvc_moe_q8(const int64_t *w, const int64_t *scales, const int64_t *starts, int64_t experts, int64_t out,
               int64_t cols, const int8_t *xq, const float *xd, float *y, int threads) {
    const int64_t blocks = cols / BLOCK, groups = (out + 7) / 8;
    int64_t count;
    moe_unit *units = moe_units(starts, experts, groups, &count);
    if (!units) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < count; u++) {
        const int64_t e = units[u].e, a0 = starts[e], a1 = starts[e + 1];
        const int8_t *we = (const int8_t *)w[e];
        const float *se = (const float *)scales[e];
        const int64_t r1 = units[u].g * 8 + 8 < out ? units[u].g * 8 + 8 : out;
        for (int64_t r = units[u].g * 8; r < r1; r++)
            for (int64_t a = a0; a < a1; a += TILE)
                q8_row(we + r * cols, se[r], r, out, blocks, xq + a * cols, xd + a * blocks,
                       a1 - a < TILE ? (int)(a1 - a) : TILE, y + a * out);
    }
    free(units);
    return 0;
}

int kvc_moe_mxfp4(const int64_t *w, const int64_t *exps, const int64_t *starts, int64_t experts, int64_t out,
                  int64_t cols, const int8_t *xq, const float *xd, float *y, int threads) {
    const int64_t blocks = cols / BLOCK, groups = (out + 7) / 8;
    int64_t count;
    moe_unit *units = moe_units(starts, experts, groups, &count);
    if (!units) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
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

/* v rounded to bfloat16 (nearest even) and kept as a float. */
static inline __m256 round_bf16(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 16 values stored: as float32, or (already bf16 values) as their upper halves. */
static inline __attribute__((always_inline)) void put16(__m256 a, __m256 b, void *out, int64_t at, const int BF16) {
    if (BF16) {
        const __m256i ha = _mm256_srli_epi32(_mm256_castps_si256(a), 16), hb = _mm256_srli_epi32(_mm256_castps_si256(b), 16);
        /* packus works per 128-bit lane: a0-3 b0-3 | a4-7 b4-7, put back in order */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(ha, hb), 0xD8);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), packed);
    } else {
        _mm256_storeu_ps((float *)out + at, a);
        _mm256_storeu_ps((float *)out + at + 8, b);
    }
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

static inline float round_bf16_1(float x) {
    return _mm256_cvtss_f32(round_bf16(_mm256_set1_ps(x)));
}

/* 8 values of a group, dequantized as kv_pool.dequantize_kv does in the output dtype (in
 * bf16: each step rounded to bf16, kept in a float). BITS and BF16 are constants at each call
 * site, so every variant is its own loop. */
static inline __attribute__((always_inline)) __m256 dequant8(__m256i q, __m256 vs, __m256 vo, const int BITS,
                                                             const int BF16) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), vs);
    if (BF16) v = round_bf16(v);
    if (BITS == 4) {
        v = _mm256_add_ps(v, vo);
        if (BF16) v = round_bf16(v);
    }
    return v;
}

/* Packed values k..k+15 of a row as two vectors of 8 integers: int8 at 8 bits, 0..15 at 4
 * (element 2i in the low nibble of byte i). */
static inline __attribute__((always_inline)) void unpack16(const uint8_t *vals, int64_t k, __m256i *q0,
                                                           __m256i *q1, const int BITS) {
    if (BITS == 8) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(vals + k));
        *q0 = _mm256_cvtepi8_epi32(b);
        *q1 = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    } else {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(vals + k / 2));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
        const __m128i q = _mm_unpacklo_epi8(lo, hi);  /* 16 values in order */
        *q0 = _mm256_cvtepu8_epi32(q);
        *q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
    }
}

static inline __attribute__((always_inline)) void gather_rows(
        const uint8_t *pool, int64_t block_bytes, int64_t region, int64_t values_bytes, const int64_t *blocks,
        int64_t n_blocks, int64_t rows, int64_t head_dim, int64_t group, void *out, int threads,
        const int BITS, const int BF16) {
    const int64_t packed = head_dim * BITS / 8, groups = head_dim / group, per = BITS == 4 ? 2 : 1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n_blocks * rows * head_dim > 65536)
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        const uint8_t *base = pool + blocks[blk] * block_bytes + region;
        const uint16_t *params = (const uint16_t *)(base + values_bytes);
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *vals = base + r * packed;
            const uint16_t *prm = params + r * groups * per;
            const int64_t row = (blk * rows + r) * head_dim;
            for (int64_t g = 0; g < groups; g++) {
                float s = _cvtsh_ss(prm[g * per]), o = BITS == 4 ? _cvtsh_ss(prm[g * per + 1]) : 0.0f;
                if (BF16) { s = round_bf16_1(s); o = round_bf16_1(o); }
                const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
                for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
                    __m256i q0, q1;
                    unpack16(vals, k, &q0, &q1, BITS);
                    put16(dequant8(q0, vs, vo, BITS, BF16), dequant8(q1, vs, vo, BITS, BF16), out, row + k, BF16);
                }
            }
        }
    }
}

/* One layer's K or V of quantized KV blocks (cache/kv_pool.py's layout), gathered and
 * dequantized into out [n_blocks * rows, head_dim] in one pass: float32, or bfloat16 where
 * bf16 is set. Block i is at pool + blocks[i] * block_bytes + region: its packed values
 * [rows, head_dim * bits / 8], then float16 parameters [rows, head_dim / group, 1 or 2].
 * The arithmetic is kv_pool.dequantize_kv's in the output dtype, step for step: the values
 * and parameters converted to it, q * scale rounded, then + offset rounded (4 bits). Groups
 * are whole multiples of 16 values. */
void kvc_gather_kv(const uint8_t *pool, int64_t block_bytes, int64_t region, int64_t values_bytes,
                   const int64_t *blocks, int64_t n_blocks, int64_t rows, int64_t head_dim, int64_t group,
                   int bits, void *out, int bf16, int threads) {
    if (bits == 8 && bf16) gather_rows(pool, block_bytes, region, values_bytes, blocks, n_blocks, rows, head_dim, group, out, threads, 8, 1);
    else if (bits == 8) gather_rows(pool, block_bytes, region, values_bytes, blocks, n_blocks, rows, head_dim, group, out, threads, 8, 0);
    else if (bf16) gather_rows(pool, block_bytes, region, values_bytes, blocks, n_blocks, rows, head_dim, group, out, threads, 4, 1);
    else gather_rows(pool, block_bytes, region, values_bytes, blocks, n_blocks, rows, head_dim, group, out, threads, 4, 0);
}

/* exp of 8 floats: Cephes' polynomial on x - n ln 2, scaled by 2^n (relative error ~2e-7).
 * Arguments below -87 give 0, as exp's float does near there. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* One row (token, head) of a K or V region into dst [head_dim] float32: q * scale (+ offset at
 * 4 bits), in float32. */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *vals, const uint16_t *prm,
                                                              int64_t head_dim, int64_t group, float *dst,
                                                              const int BITS) {
    const int64_t groups = head_dim / group;
    for (int64_t g = 0; g < groups; g++) {
        const __m256 vs = _mm256_set1_ps(_cvtsh_ss(prm[g * (BITS == 4 ? 2 : 1)]));
        const __m256 vo = _mm256_set1_ps(BITS == 4 ? _cvtsh_ss(prm[g * 2 + 1]) : 0.0f);
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
            __m256i q0, q1;
            unpack16(vals, k, &q0, &q1, BITS);
            _mm256_storeu_ps(dst + k, dequant8(q0, vs, vo, BITS, 0));
            _mm256_storeu_ps(dst + k + 8, dequant8(q1, vs, vo, BITS, 0));
        }
    }
}

/* Tokens of context one task of kvc_attend_kv covers (all KV heads of one sequence): several
 * tasks per sequence keep both threads busy; their partial softmaxes merge. */
#define ATTEND_CHUNK 256
/* Tokens multiplied together: eight independent dot products (K) and eight products per
 * output vector (V) keep the FMA units busy instead of waiting on one sum's latency. */
#define ATTEND_TILE 8

/* Lane i: the sum of v[i]'s eight lanes. */
static inline __m256 hsum8x8(const __m256 *v) {
    const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a01, a23), b1 = _mm256_hadd_ps(a45, a67);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Asks for the packed rows and parameters of tokens t..t+ATTEND_TILE-1, every head, in one
 * region ahead of their use: dequantizing leaves the loads too few to hide the misses of
 * blocks that lie anywhere in the pool (float32 rows were as fast or faster without). */
static inline __attribute__((always_inline)) void prefetch_tile(
        const uint8_t *pool, int64_t block_bytes, int64_t region, int64_t values_bytes, const int64_t *table,
        int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int64_t t, int64_t t1,
        const int BITS) {
    const int64_t packed = head_dim * BITS / 8, params = head_dim / group * (BITS == 4 ? 2 : 1) * 2;
    for (int64_t i = t; i < t + ATTEND_TILE && i < t1; ) {
        const int64_t off = i % block_size;
        const int64_t end = i + (block_size - off) < t + ATTEND_TILE ? i + (block_size - off) : t + ATTEND_TILE;
        const int64_t rows = ((end < t1 ? end : t1) - i) * kv_heads;
        const uint8_t *base = pool + table[i / block_size] * block_bytes + region;
        for (int64_t b = 0; b < rows * packed; b += 64) _mm_prefetch((const char *)(base + off * kv_heads * packed + b), _MM_HINT_T0);
        for (int64_t b = 0; b < rows * params; b += 64)
            _mm_prefetch((const char *)(base + values_bytes + off * kv_heads * params + b), _MM_HINT_T0);
        i = end;
    }
}

/* The float32 rows of tokens t..t+m-1 (m <= ATTEND_TILE) of one head in one region: where
 * they lie (BITS 32), widened from bf16 (16) or dequantized (8, 4) into tile; rows past m
 * point at zeros. With the first head, packed rows two tiles on are asked for (t1: the end
 * of the task's tokens). */
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *pool, int64_t block_bytes, int64_t region, int64_t values_bytes, const int64_t *table,
        int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int64_t head, int64_t t, int64_t m,
        int64_t t1, float *tile, const float *zeros, const float **rows, const int BITS) {
    if (BITS < 16 && head == 0)
        prefetch_tile(pool, block_bytes, region, values_bytes, table, block_size, kv_heads, head_dim, group,
                      t + 2 * ATTEND_TILE, t1, BITS);
    const int64_t packed = head_dim * BITS / 8;
    const int64_t per = BITS == 4 ? 2 : 1, groups = BITS >= 16 ? 1 : head_dim / group;
    int64_t blk = t / block_size, off = t % block_size;  /* one division a tile, not two a row */
    for (int64_t i = 0; i < ATTEND_TILE; i++, off++) {
        if (off == block_size) { blk++; off = 0; }
        if (i >= m) { rows[i] = zeros; continue; }
        const int64_t r = off * kv_heads + head;
        const uint8_t *base = pool + table[blk] * block_bytes + region;
        if (BITS == 32) {
            rows[i] = (const float *)(base + r * packed);
        } else if (BITS == 16) {  /* bf16: the upper half of a float32 */
            const uint16_t *src = (const uint16_t *)(base + r * packed);
            for (int64_t k = 0; k < head_dim; k += 8) {
                const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + k)));
                _mm256_storeu_ps(tile + i * head_dim + k, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
            rows[i] = tile + i * head_dim;
        } else {
            dequant_row(base + r * packed, (const uint16_t *)(base + values_bytes) + r * groups * per,
                        head_dim, group, tile + i * head_dim, BITS);
            rows[i] = tile + i * head_dim;
        }
    }
}

/* One task: tokens t0..t1-1 of one sequence's blocks, every KV head (a token's heads lie side
 * by side, so the task reads its blocks front to back), for R query rows of that sequence:
 * row r sees the tokens before ends[r] (a row whose end is at or before t0 has nothing here and
 * is left alone). Query head (head, j) of row r is row r * heads + head * gq + j of q, acc
 * [.., head_dim], m_out, l_out and scores [.., ATTEND_CHUNK]. Each (row, query head) is
 * computed by the same operations in the same order whatever the other rows: a query's
 * numbers do not depend on how many rows a step attends with it (the K and V tiles are only
 * read once for all of them). */
static inline __attribute__((always_inline)) void attend_chunk(
        const uint8_t *pool, int64_t block_bytes, int64_t k_region, int64_t v_region, int64_t values_bytes,
        const int64_t *table, int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group,
        const float *q, int64_t R, const int64_t *ends, int64_t gq, float scale, int64_t window, int64_t t0,
        int64_t t1, float *m_out, float *l_out, float *acc, float *scores, float *tile, const float *zeros,
        const int BITS) {
    /* BITS 32 / 16: float32 / bf16 rows, no parameters (group and values_bytes unused). window:
     * a row sees its last `window` keys only (0: all); keys before them score -inf here. */
    const int64_t heads = kv_heads * gq;
    const float *rows[ATTEND_TILE];
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t t = t0; t < t1; t += ATTEND_TILE) {
        const int64_t m = t1 - t < ATTEND_TILE ? t1 - t : ATTEND_TILE;
        for (int64_t head = 0; head < kv_heads; head++) {
            tile_rows(pool, block_bytes, k_region, values_bytes, table, block_size, kv_heads, head_dim, group, head,
                      t, m, t1, tile, zeros, rows, BITS);
            for (int64_t r = 0; r < R; r++) {
                const int64_t e = ends[r] < t1 ? ends[r] : t1;
                if (t >= e || (window > 0 && t + ATTEND_TILE <= ends[r] - window)) continue;
                const int64_t mr = e - t < ATTEND_TILE ? e - t : ATTEND_TILE;
                for (int64_t j = r * heads + head * gq; j < r * heads + (head + 1) * gq; j++) {
                    __m256 a[ATTEND_TILE];
                    for (int i = 0; i < ATTEND_TILE; i++) a[i] = _mm256_setzero_ps();
                    for (int64_t k = 0; k < head_dim; k += 8) {
                        const __m256 qk = _mm256_loadu_ps(q + j * head_dim + k);
                        for (int i = 0; i < ATTEND_TILE; i++)
                            a[i] = _mm256_fmadd_ps(qk, _mm256_loadu_ps(rows[i] + k), a[i]);
                    }
                    const __m256 sv = _mm256_mul_ps(hsum8x8(a), vscale);
                    if (mr == ATTEND_TILE) {
                        _mm256_storeu_ps(scores + j * ATTEND_CHUNK + (t - t0), sv);
                    } else {
                        float part[ATTEND_TILE];
                        _mm256_storeu_ps(part, sv);
                        memcpy(scores + j * ATTEND_CHUNK + (t - t0), part, mr * sizeof(float));
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = (ends[r] < t1 ? ends[r] : t1) - t0;
        if (n <= 0) continue;
        /* keys before the row's window: none of the softmax (all of them: a chunk that adds nothing) */
        int64_t hidden = window > 0 && ends[r] - window > t0 ? ends[r] - window - t0 : 0;
        if (hidden > n) hidden = n;
        for (int64_t j = r * heads; j < (r + 1) * heads; j++) {
            float *s = scores + j * ATTEND_CHUNK;
            if (hidden == n) {
                memset(s, 0, n * sizeof(float));
                m_out[j] = -INFINITY;
                l_out[j] = 0.0f;
                memset(acc + j * head_dim, 0, head_dim * sizeof(float));
                continue;
            }
            for (int64_t i = 0; i < hidden; i++) s[i] = -INFINITY;
            float m = -INFINITY;
            {  /* a maximum is exact in any order: 8 lanes, then the rest */
                __m256 vmax = _mm256_set1_ps(-INFINITY);
                int64_t i = 0;
                for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
                float lanes[8];
                _mm256_storeu_ps(lanes, vmax);
                for (int k = 0; k < 8; k++) m = fmaxf(m, lanes[k]);
                for (; i < n; i++) m = fmaxf(m, s[i]);
            }
            const __m256 vm = _mm256_set1_ps(m);
            __m256 sum = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
                _mm256_storeu_ps(s + i, p);
                sum = _mm256_add_ps(sum, p);
            }
            float l = hsum(sum);
            for (; i < n; i++) { s[i] = expf(s[i] - m); l += s[i]; }
            m_out[j] = m;
            l_out[j] = l;
            memset(acc + j * head_dim, 0, head_dim * sizeof(float));
        }
    }
    for (int64_t t = t0; t < t1; t += ATTEND_TILE) {
        const int64_t m = t1 - t < ATTEND_TILE ? t1 - t : ATTEND_TILE;
        for (int64_t head = 0; head < kv_heads; head++) {
            tile_rows(pool, block_bytes, v_region, values_bytes, table, block_size, kv_heads, head_dim, group, head,
                      t, m, t1, tile, zeros, rows, BITS);
            for (int64_t r = 0; r < R; r++) {
                const int64_t e = ends[r] < t1 ? ends[r] : t1;
                if (t >= e || (window > 0 && t + ATTEND_TILE <= ends[r] - window)) continue;
                const int64_t mr = e - t < ATTEND_TILE ? e - t : ATTEND_TILE;
                for (int64_t j = r * heads + head * gq; j < r * heads + (head + 1) * gq; j++) {
                    __m256 p[ATTEND_TILE];
                    for (int i = 0; i < ATTEND_TILE; i++)
                        p[i] = _mm256_set1_ps(i < mr ? scores[j * ATTEND_CHUNK + (t - t0) + i] : 0.0f);
                    float *a = acc + j * head_dim;
                    for (int64_t k = 0; k < head_dim; k += 8) {
                        __m256 x = _mm256_loadu_ps(a + k);
                        for (int i = 0; i < mr; i++) x = _mm256_fmadd_ps(p[i], _mm256_loadu_ps(rows[i] + k), x);
                        _mm256_storeu_ps(a + k, x);
                    }
                }
            }
        }
    }
}

/* A task's chunk: attend_chunk at the pool's bits (the compiler specialises each). */
static void attend_chunk_bits(
        const uint8_t *pool, int64_t block_bytes, int64_t k_region, int64_t v_region, int64_t values_bytes,
        const int64_t *table, int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int bits,
        const float *q, int64_t R, const int64_t *ends, int64_t gq, float scale, int64_t window, int64_t t0,
        int64_t t1, float *m_out, float *l_out, float *acc, float *scores, float *tile, const float *zeros) {
    if (bits == 8)
        attend_chunk(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads, head_dim,
                     group, q, R, ends, gq, scale, window, t0, t1, m_out, l_out, acc, scores, tile, zeros, 8);
    else if (bits == 4)
        attend_chunk(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads, head_dim,
                     group, q, R, ends, gq, scale, window, t0, t1, m_out, l_out, acc, scores, tile, zeros, 4);
    else if (bits == 16)
        attend_chunk(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads, head_dim,
                     group, q, R, ends, gq, scale, window, t0, t1, m_out, l_out, acc, scores, tile, zeros, 16);
    else
        attend_chunk(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads, head_dim,
                     group, q, R, ends, gq, scale, window, t0, t1, m_out, l_out, acc, scores, tile, zeros, 32);
}

/* One query head's output from its chunks' partial softmaxes (chunk c: maximum m[c * stride],
 * sum l[c * stride], weighted values a + c * astride), merged in chunk order. */
/* sink: an attention sink's logit (gpt-oss), a key without a value that takes its share of
 * the softmax; -INFINITY where the model has none (then it changes no bit). */
static void merge_chunks(const float *m, const float *l, int64_t stride, const float *a, int64_t astride,
                         int64_t chunks, int64_t head_dim, float sink, float *o) {
    float top = sink, total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) top = fmaxf(top, m[c * stride]);
    if (sink > -INFINITY) total = expf(sink - top);
    memset(o, 0, head_dim * sizeof(float));
    for (int64_t c = 0; c < chunks; c++) {
        const float w = expf(m[c * stride] - top);
        total += l[c * stride] * w;
        const float *ac = a + c * astride;
        for (int64_t k = 0; k < head_dim; k++) o[k] += ac[k] * w;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;  /* no context: zeros */
    for (int64_t k = 0; k < head_dim; k++) o[k] *= inv;
}

/* Query rows of one sequence attended together by one task of kvc_attend_kv: their K and V
 * tiles are read once for all of them. */
#define ATTEND_ROWS 8

/* Attention of query positions over their sequence's KV blocks, read where they lie (no
 * gathered or dequantized copy of the context); bits 8 or 4 (packed, kvc_gather_kv's layout),
 * 16 or 32 (bf16 or float32 blocks, [layers, 2, block_size, kv_heads, head_dim]). Sequence s
 * has rows[s] query rows (its decode token: 1; a prefill chunk: its tokens), the last one
 * seeing the first contexts[s] tokens of the blocks in tables[s * table_width ...] and each
 * earlier one a token fewer (causal). q float32 [sum of rows, kv_heads, gq, head_dim] (the gq
 * query heads of each KV head; a sequence's rows one after the other), out the same shape.
 * Every (query row, chunk of ATTEND_CHUNK tokens) has its own softmax per query head, and the
 * chunks merge through their maxima and sums in order, by the same operations for every row
 * however many rows its sequence has: a token's attention does not depend on the step it runs
 * in. A one-row sequence's chunks are tasks of their own (a long context keeps every thread
 * busy); a longer sequence's rows go ATTEND_ROWS at a time, each task taking its chunks in
 * turn. head_dim a multiple of 16. Returns 0; -1 if scratch memory could not be had, -2 if a
 * block it would read lies outside the pool's n_blocks or a context outside its table (out
 * untouched). */
int kvc_attend_kv(const uint8_t *pool, int64_t n_blocks, int64_t block_bytes, int64_t k_region, int64_t v_region,
                  int64_t values_bytes, const int64_t *tables, int64_t table_width, const int64_t *contexts,
                  const int64_t *rows, int64_t n_seq, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                  int64_t group, int bits, const float *q, int64_t gq, float scale, const float *sinks,
                  int64_t window, float *out, int threads) {
    for (int64_t s = 0; s < n_seq; s++) {  /* every block read inside the pool */
        if (contexts[s] < 0 || contexts[s] > table_width * block_size || rows[s] < 1 || rows[s] > contexts[s] + 1)
            return -2;
        for (int64_t i = 0; i < (contexts[s] + block_size - 1) / block_size; i++)
            if (tables[s * table_width + i] < 0 || tables[s * table_width + i] >= n_blocks) return -2;
    }
    const int64_t heads = kv_heads * gq;  /* query heads */
    /* tasks: a one-row sequence's chunks, then a longer one's groups of rows */
    int64_t *first = malloc((n_seq + 1) * sizeof(int64_t)), *row0 = malloc((n_seq + 1) * sizeof(int64_t));
    if (!first || !row0) { free(first); free(row0); return -1; }
    first[0] = row0[0] = 0;
    int64_t chunk_tasks = 0;
    for (int64_t s = 0; s < n_seq; s++) {
        const int64_t chunks = (contexts[s] + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
        first[s + 1] = first[s] + (rows[s] == 1 ? chunks : (rows[s] + ATTEND_ROWS - 1) / ATTEND_ROWS);
        row0[s + 1] = row0[s] + rows[s];
        if (rows[s] == 1) chunk_tasks += chunks;
    }
    const int64_t tasks = first[n_seq];
    /* the one-row sequences' partials: per chunk task, heads x head_dim values, then maxima and sums */
    float *part = malloc((chunk_tasks * heads * (head_dim + 2) + 1) * sizeof(float));
    int64_t *slot = malloc((tasks + 1) * sizeof(int64_t));  /* a chunk task's place in part */
    if (!part || !slot) { free(first); free(row0); free(part); free(slot); return -1; }
    for (int64_t s = 0, next = 0; s < n_seq; s++)
        for (int64_t task = first[s]; task < first[s + 1]; task++) slot[task] = rows[s] == 1 ? next++ : -1;
    float *ml = part + chunk_tasks * heads * head_dim;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (tasks > 1)
    {
        /* scores of a chunk for up to ATTEND_ROWS rows, a tile of dequantized rows, a row of zeros */
        float *scores = calloc(ATTEND_ROWS * heads * ATTEND_CHUNK + (ATTEND_TILE + 1) * head_dim, sizeof(float));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            int64_t s = 0;
            while (first[s + 1] <= task) s++;
            float *tile = scores + ATTEND_ROWS * heads * ATTEND_CHUNK;
            const float *zeros = tile + ATTEND_TILE * head_dim;
            const int64_t *table = tables + s * table_width;
            if (rows[s] == 1) {
                const int64_t t0 = (task - first[s]) * ATTEND_CHUNK;
                const int64_t t1 = t0 + ATTEND_CHUNK < contexts[s] ? t0 + ATTEND_CHUNK : contexts[s];
                float *m = ml + slot[task] * heads * 2;
                attend_chunk_bits(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads,
                                  head_dim, group, bits, q + row0[s] * heads * head_dim, 1, contexts + s, gq, scale,
                                  window, t0, t1, m, m + heads, part + slot[task] * heads * head_dim, scores, tile,
                                  zeros);
                continue;
            }
            /* rows r0..r0+R-1 of the sequence: all their chunks, then their outputs */
            const int64_t r0 = (task - first[s]) * ATTEND_ROWS;
            const int64_t R = rows[s] - r0 < ATTEND_ROWS ? rows[s] - r0 : ATTEND_ROWS;
            int64_t ends[ATTEND_ROWS];
            for (int64_t r = 0; r < R; r++) ends[r] = contexts[s] - rows[s] + 1 + r0 + r;
            const int64_t chunks = (ends[R - 1] + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
            /* per chunk: R x heads x head_dim values, then R x heads maxima and R x heads sums */
            const int64_t per = R * heads * (head_dim + 2);
            float *own = malloc(chunks * per * sizeof(float));
            if (!own) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t t0 = c * ATTEND_CHUNK;
                const int64_t t1 = t0 + ATTEND_CHUNK < ends[R - 1] ? t0 + ATTEND_CHUNK : ends[R - 1];
                float *cp = own + c * per, *m = cp + R * heads * head_dim;
                attend_chunk_bits(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads,
                                  head_dim, group, bits, q + (row0[s] + r0) * heads * head_dim, R, ends, gq, scale,
                                  window, t0, t1, m, m + R * heads, cp, scores, tile, zeros);
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t mine = (ends[r] + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
                for (int64_t j = r * heads; j < (r + 1) * heads; j++) {
                    const float *m = own + R * heads * head_dim + j;
                    merge_chunks(m, m + R * heads, per, own + j * head_dim, per, mine, head_dim,
                                 sinks ? sinks[j - r * heads] : -INFINITY, out + ((row0[s] + r0) * heads + j) * head_dim);
                }
            }
            free(own);
        }
        free(scores);
    }
    if (!failed) {
        #pragma omp parallel for schedule(static) num_threads(threads) if (chunk_tasks * heads * head_dim > 65536)
        for (int64_t sj = 0; sj < n_seq * heads; sj++) {
            const int64_t s = sj / heads, j = sj % heads;
            if (rows[s] != 1) continue;
            const float *m = ml + slot[first[s]] * heads * 2 + j;
            merge_chunks(m, m + heads, heads * 2, part + (slot[first[s]] * heads + j) * head_dim, heads * head_dim,
                         first[s + 1] - first[s], head_dim, sinks ? sinks[j] : -INFINITY,
                         out + (row0[s] * heads + j) * head_dim);
        }
    }
    free(part);
    free(slot);
    free(first);
    free(row0);
    return failed ? -1 : 0;
}

static inline float param16(float x, uint16_t *dst) {  /* stored as float16 (nearest even), read back */
    const uint16_t h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    *dst = h;
    return _cvtsh_ss(h);
}

/* Rows x [n_rows, kv_heads, head_dim] (float32, or bfloat16 where x_bf16) quantized into one
 * layer's K or V region of the blocks: row t goes to offset offsets[t] of block blocks[t].
 * Bit for bit kv_pool.quantize_kv: values clamped to float16's range; 8 bits: scale =
 * float16(max|x| / 127), q = round(x / scale); 4 bits: offset = float16(min), scale =
 * float16((max - min) / 15), q = round((x - offset) / scale) in 0..15; a scale of 0 divides
 * by 1; rounding half to even, true division, as torch computes them. Returns -1, writing
 * nothing, if a slot lies outside the pool's n_blocks blocks of block_size. */
int kvc_write_kv(uint8_t *pool, int64_t n_blocks, int64_t block_size, int64_t block_bytes, int64_t region,
                 int64_t values_bytes, const int64_t *blocks, const int64_t *offsets, int64_t n_rows,
                 int64_t kv_heads, int64_t head_dim, int64_t group, int bits, const void *x, int x_bf16,
                 int threads) {
    for (int64_t t = 0; t < n_rows; t++)  /* every slot inside the pool, or nothing written */
        if (blocks[t] < 0 || blocks[t] >= n_blocks || offsets[t] < 0 || offsets[t] >= block_size) return -1;
    const int64_t packed = head_dim * bits / 8, groups = head_dim / group, per = bits == 4 ? 2 : 1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n_rows * kv_heads * head_dim > 65536)
    for (int64_t t = 0; t < n_rows; t++) {
        uint8_t *base = pool + blocks[t] * block_bytes + region;
        float g[512];  /* one group; the caller keeps groups within 512 values */
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t r = offsets[t] * kv_heads + h, at = (t * kv_heads + h) * head_dim;
            uint8_t *vals = base + r * packed;
            uint16_t *prm = (uint16_t *)(base + values_bytes) + r * groups * per;
            for (int64_t j = 0; j < groups; j++) {
                const int64_t n = group;
                for (int64_t i = 0; i < n; i++) {
                    float v;
                    if (x_bf16) {
                        const uint32_t u = (uint32_t)((const uint16_t *)x)[at + j * group + i] << 16;
                        memcpy(&v, &u, sizeof v);
                    } else {
                        v = ((const float *)x)[at + j * group + i];
                    }
                    g[i] = fminf(fmaxf(v, -65504.0f), 65504.0f);
                }
                if (bits == 8) {
                    float amax = 0.0f;
                    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(g[i]));
                    const float scale = param16(amax / 127.0f, prm + j);
                    const float step = scale > 0.0f ? scale : 1.0f;
                    for (int64_t i = 0; i < n; i++) {
                        const float q = fminf(fmaxf(nearbyintf(g[i] / step), -127.0f), 127.0f);
                        vals[j * group + i] = (uint8_t)(int8_t)q;
                    }
                } else {
                    float low = g[0], high = g[0];
                    for (int64_t i = 1; i < n; i++) { low = fminf(low, g[i]); high = fmaxf(high, g[i]); }
                    const float scale = param16((high - low) / 15.0f, prm + j * 2);
                    const float offset = param16(low, prm + j * 2 + 1);
                    const float step = scale > 0.0f ? scale : 1.0f;
                    for (int64_t i = 0; i < n; i += 2) {
                        const float a = fminf(fmaxf(nearbyintf((g[i] - offset) / step), 0.0f), 15.0f);
                        const float b = fminf(fmaxf(nearbyintf((g[i + 1] - offset) / step), 0.0f), 15.0f);
                        vals[(j * group + i) / 2] = (uint8_t)((int)a | ((int)b << 4));
                    }
                }
            }
        }
    }
    return 0;
}

/* CRC-32 as zlib computes it (reflected polynomial 0xEDB88320), folding 4 x 128 bits of the
 * buffer at a time with carry-less multiplication (Gopal et al., "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction", Intel, 2009; the constants are that
 * paper's x^n mod P for this polynomial, bit-reflected), then reduced to 32 bits (Barrett).
 * The block files' checksum: zlib 1.2's loop reads a byte at a time. */
#define CLMUL __attribute__((target("pclmul,sse4.1")))

static uint32_t crc32_bytes(uint32_t c, const uint8_t *p, int64_t n) {  /* c: the inverted state */
    while (n-- > 0) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return c;
}

/* len >= 64, a multiple of 16; c and the result: the inverted state. */
static CLMUL uint32_t crc32_fold(const uint8_t *buf, int64_t len, uint32_t c) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i x[4];
    for (int i = 0; i < 4; i++) x[i] = _mm_loadu_si128((const __m128i *)(buf + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)c));
    buf += 64;
    len -= 64;
    for (; len >= 64; buf += 64, len -= 64)
        for (int i = 0; i < 4; i++) {
            const __m128i lo = _mm_clmulepi64_si128(x[i], k1k2, 0x00), hi = _mm_clmulepi64_si128(x[i], k1k2, 0x11);
            x[i] = _mm_xor_si128(_mm_xor_si128(lo, hi), _mm_loadu_si128((const __m128i *)(buf + 16 * i)));
        }
    __m128i r = x[0];
    for (int i = 1; i < 4; i++) {  /* the four lanes into one */
        const __m128i lo = _mm_clmulepi64_si128(r, k3k4, 0x00), hi = _mm_clmulepi64_si128(r, k3k4, 0x11);
        r = _mm_xor_si128(_mm_xor_si128(lo, hi), x[i]);
    }
    for (; len >= 16; buf += 16, len -= 16) {
        const __m128i lo = _mm_clmulepi64_si128(r, k3k4, 0x00), hi = _mm_clmulepi64_si128(r, k3k4, 0x11);
        r = _mm_xor_si128(_mm_xor_si128(lo, hi), _mm_loadu_si128((const __m128i *)buf));
    }
    /* 128 -> 64 bits, then 64 -> 32 by Barrett reduction */
    __m128i t = _mm_clmulepi64_si128(r, k3k4, 0x10);
    r = _mm_xor_si128(_mm_srli_si128(r, 8), t);
    t = _mm_srli_si128(r, 4);
    r = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(r, low32), k5, 0x00), t);
    t = _mm_clmulepi64_si128(_mm_and_si128(r, low32), poly, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(r, t), 1);
}

/* zlib.crc32(buf, crc): the CRC-32 of len bytes after crc. */
uint32_t kvc_crc32(const uint8_t *buf, int64_t len, uint32_t crc) {
    uint32_t c = ~crc;
    if (len >= 64) {
        const int64_t n = len & ~(int64_t)15;
        c = crc32_fold(buf, n, c);
        buf += n;
        len -= n;
    }
    return ~crc32_bytes(c, buf, len);
}
