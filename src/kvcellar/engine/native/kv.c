/* KV blocks of the pool, read and written where they lie: quantized blocks gathered
 * (dequantized) and written (quantized) bit for bit as kv_pool's torch code does, and attention
 * of query positions over a sequence's blocks (kvc_attend_kv). */
#include "kvc.h"

#include <stdatomic.h>

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
/* Tiles of values a query's outputs are multiplied over before they go back to memory (AVX-512). */
#define PV_SPAN 4

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
 * point at zeros; raw: bf16 rows where they lie too (their reader widens them). With the
 * first head, packed rows two tiles on are asked for (t1: the end of the task's tokens). */
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *pool, int64_t block_bytes, int64_t region, int64_t values_bytes, const int64_t *table,
        int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int64_t head, int64_t t, int64_t m,
        int64_t t1, float *tile, const float *zeros, const float **rows, const int BITS, int raw) {
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
        } else if (BITS == 16 && raw) {  /* bf16 rows where they lie, widened as they are read */
            rows[i] = (const float *)(base + r * packed);
        } else if (BITS == 16) {  /* bf16: the upper half of a float32 */
            const uint16_t *src = (const uint16_t *)(base + r * packed);
            for (int64_t k = 0; k < head_dim; k += 8) _mm256_storeu_ps(tile + i * head_dim + k, load8_bf16(src + k));
            rows[i] = tile + i * head_dim;
        } else {
            dequant_row(base + r * packed, (const uint16_t *)(base + values_bytes) + r * groups * per,
                        head_dim, group, tile + i * head_dim, BITS);
            rows[i] = tile + i * head_dim;
        }
    }
}

/* ---- The same operations where the CPU has AVX-512: two of them an instruction ----------- */

/* Keys i and i + 4 of a tile side by side, 8 inputs at a time: kt[(i * head_dim / 8 + c) * 16]
 * holds inputs 8c..8c+7 of key i, then those of key i + 4 (i < 4). */
static inline AVX512 __attribute__((always_inline)) void pair_keys_n(const float *const *rows, int64_t head_dim,
                                                                    float *kt, const int BF16) {
    const int64_t n = head_dim / 8;
    for (int i = 0; i < 4; i++)
        for (int64_t c = 0; c < n; c++) {
            if (BF16) {  /* rows of bf16 (tile_rows' raw): each value the upper half of its float32 */
                const __m128i lo = _mm_loadu_si128((const __m128i *)((const uint16_t *)rows[i] + 8 * c));
                const __m128i hi = _mm_loadu_si128((const __m128i *)((const uint16_t *)rows[i + 4] + 8 * c));
                const __m512i both = _mm512_cvtepu16_epi32(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
                _mm512_storeu_ps(kt + (i * n + c) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(both, 16)));
            } else {
                _mm256_storeu_ps(kt + (i * n + c) * 16, _mm256_loadu_ps(rows[i] + 8 * c));
                _mm256_storeu_ps(kt + (i * n + c) * 16 + 8, _mm256_loadu_ps(rows[i + 4] + 8 * c));
            }
        }
}

static AVX512 void pair_keys(const float *const *rows, int64_t head_dim, float *kt, int bf16) {
    if (bf16) pair_keys_n(rows, head_dim, kt, 1); else pair_keys_n(rows, head_dim, kt, 0);
}

/* _mm256_hadd_ps of the lower halves of a and b, and of their upper halves: each 128-bit lane
 * [a0 + a1, a2 + a3, b0 + b1, b2 + b3], the same sums. */
static inline AVX512 __attribute__((always_inline)) __m512 hadd512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* bf16 rows (m of them, where they lie) widened into tile, 16 values an instruction; rows then
 * point there. */
static AVX512 void widen_bf16_rows(const float **rows, int64_t m, int64_t head_dim, float *tile) {
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *src = (const uint16_t *)rows[i];
        for (int64_t k = 0; k < head_dim; k += 16) _mm512_storeu_ps(tile + i * head_dim + k, load16_bf16(src + k));
        rows[i] = tile + i * head_dim;
    }
}

/* The unscaled scores of NQ queries (q[h]: any row's, any head's) against a tile paired by
 * pair_keys: out[h] lane i, key i's. Each lane is the AVX2 loop's chain of multiply-adds for its
 * key (lanes 8-15 of a pair: key i + 4's), summed by the same hsum8x8: the same bits, whichever
 * queries share the call (the key tile is read once for all of them). */
static inline AVX512 __attribute__((always_inline)) void qk_wide_n(const float *const *q, const float *kt,
                                                                  int64_t head_dim, __m256 *out, const int NQ) {
    const int64_t n = head_dim / 8;
    __m512 a[4][4];
    for (int h = 0; h < NQ; h++)
        for (int i = 0; i < 4; i++) a[h][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c++) {
        __m512 qc[4];
        for (int h = 0; h < NQ; h++) {  /* inputs 8c..8c+7 of query h in both halves */
            const __m256d half = _mm256_loadu_pd((const double *)(q[h] + 8 * c));
            qc[h] = _mm512_castpd_ps(_mm512_broadcast_f64x4(half));
        }
        for (int i = 0; i < 4; i++) {
            const __m512 k = _mm512_loadu_ps(kt + (i * n + c) * 16);
            for (int h = 0; h < NQ; h++) a[h][i] = _mm512_fmadd_ps(qc[h], k, a[h][i]);
        }
    }
    for (int h = 0; h < NQ; h++) {  /* hsum8x8's sums, both halves of each register at once */
        const __m512 b = hadd512(hadd512(a[h][0], a[h][1]), hadd512(a[h][2], a[h][3]));
        const __m512 lanes = _mm512_shuffle_f32x4(b, b, _MM_SHUFFLE(3, 1, 2, 0));  /* keys 0-3 | 4-7, twice */
        out[h] = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
    }
}

/* qk_wide_n for 1..4 queries. */
static AVX512 void qk_wide(const float *const *q, int nq, const float *kt, int64_t head_dim, __m256 *out) {
    switch (nq) {
        case 4: qk_wide_n(q, kt, head_dim, out, 4); break;
        case 3: qk_wide_n(q, kt, head_dim, out, 3); break;
        case 2: qk_wide_n(q, kt, head_dim, out, 2); break;
        default: qk_wide_n(q, kt, head_dim, out, 1);
    }
}

/* Outputs k0..k0+16N-1 of NH queries (acc[h], p[h]: any row's, any head's) += the
 * probabilities x value rows 0..mr-1, in N vectors a query that chain their multiply-adds side
 * by side (one vector alone waited on each of its own); each output's chain is the AVX2 loop's,
 * in its order, and each value vector is read once for the NH queries. */
static inline AVX512 __attribute__((always_inline)) void pv_block(float *const *acc, const float *const *p, int mr,
                                                                 const float *const *rows, int64_t k0, const int NH,
                                                                 const int N, const int BF16) {
    __m512 x[4][4];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < N; c++) x[h][c] = _mm512_loadu_ps(acc[h] + k0 + 16 * c);
    for (int i = 0; i < mr; i++) {
        __m512 w[4];
        for (int h = 0; h < NH; h++) w[h] = _mm512_set1_ps(p[h][i]);
        for (int c = 0; c < N; c++) {
            const __m512 v = BF16 ? load16_bf16((const uint16_t *)rows[i] + k0 + 16 * c)
                                  : _mm512_loadu_ps(rows[i] + k0 + 16 * c);
            for (int h = 0; h < NH; h++) x[h][c] = _mm512_fmadd_ps(w[h], v, x[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < N; c++) _mm512_storeu_ps(acc[h] + k0 + 16 * c, x[h][c]);
}

/* acc[h][..] += the probabilities p[h][i] x value row i (i < mr) for nq <= 4 queries, 16
 * outputs a vector: each output's chain of multiply-adds in the AVX2 loop's order. */
static AVX512 void pv_wide(float *const *acc, const float *const *p, int nq, int mr, const float *const *rows,
                           int64_t head_dim, int bf16) {
    for (int64_t k0 = 0; k0 < head_dim; k0 += 64) {
        const int64_t n = head_dim - k0 < 64 ? (head_dim - k0) / 16 : 4;
#define PV(NH, N) if (bf16) pv_block(acc, p, mr, rows, k0, NH, N, 1); else pv_block(acc, p, mr, rows, k0, NH, N, 0)
#define PV_N(N) switch (nq) { case 4: PV(4, N); break; case 3: PV(3, N); break; case 2: PV(2, N); break; \
                              default: PV(1, N); }
        switch (n) {  /* each count its own constant: the chains stay in registers */
            case 4: PV_N(4); break;
            case 3: PV_N(3); break;
            case 2: PV_N(2); break;
            default: PV_N(1);
        }
#undef PV_N
#undef PV
    }
}

/* The softmax's loop below on 16 lanes, as far as whole vectors of 16 go: s[i] = exp(s[i] - m)
 * in place, each vector's halves added to *sum one after the other, as the 8-lane loop adds
 * them (exp16's lanes are exp8's: the same bits). Returns where the 8-lane loop goes on. */
static AVX512 int64_t exp_wide(float *s, int64_t n, float m, __m256 *sum) {
    const __m512 vm = _mm512_set1_ps(m);
    __m256 acc = *sum;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(s + i, p);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(p));
        acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
    }
    *sum = acc;
    return i;
}

/* The maximum of s[0..n) as far as whole groups of 64 go, into *vmax's lanes: four chains side
 * by side (one chain of 8 lanes waited on each maximum's latency). Returns where the 8-lane loop
 * goes on. */
static AVX512 int64_t max_wide(const float *s, int64_t n, __m256 *vmax) {
    __m512 m[4];
    for (int k = 0; k < 4; k++) m[k] = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int k = 0; k < 4; k++) m[k] = _mm512_max_ps(m[k], _mm512_loadu_ps(s + i + 16 * k));
    const __m512 all = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
    *vmax = _mm256_max_ps(*vmax, _mm256_max_ps(_mm512_castps512_ps256(all),
                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1))));
    return i;
}

/* How many keys of the tile at t a row that sees the tokens before `end` takes (tokens before
 * t1, its window's last keys only): 0 where it sees none of them. */
static inline __attribute__((always_inline)) int64_t tile_seen(int64_t end, int64_t t, int64_t t1, int64_t window) {
    const int64_t e = end < t1 ? end : t1;
    if (t >= e || (window > 0 && t + ATTEND_TILE <= end - window)) return 0;
    return e - t < ATTEND_TILE ? e - t : ATTEND_TILE;
}

/* How many keys of the span t..te-1 (whole tiles from t, te <= t1) a row that sees the tokens
 * before `end` takes: tile_seen where the span is one tile; longer spans are taken without a
 * window only, where a row sees a prefix of them. */
static inline __attribute__((always_inline)) int64_t span_seen(int64_t end, int64_t t, int64_t te, int64_t t1,
                                                               int64_t window) {
    if (te - t <= ATTEND_TILE) return tile_seen(end, t, t1, window);
    const int64_t e = end < te ? end : te;
    return e > t ? e - t : 0;
}

/* A tile's scores (mr of them) into dst. */
static inline __attribute__((always_inline)) void store_scores(float *dst, __m256 sv, int64_t mr) {
    if (mr == ATTEND_TILE) {
        _mm256_storeu_ps(dst, sv);
    } else {
        float part[ATTEND_TILE];
        _mm256_storeu_ps(part, sv);
        memcpy(dst, part, mr * sizeof(float));
    }
}

/* The scores of nb queries (qp) against a paired tile kt, scaled, into dst (cnt of each). */
static inline __attribute__((always_inline)) void score_queries(const float *const *qp, float *const *dst,
                                                               const int64_t *cnt, int nb, const float *kt,
                                                               int64_t head_dim, __m256 vscale) {
    __m256 sums[4];
    qk_wide(qp, nb, kt, head_dim, sums);
    for (int b = 0; b < nb; b++) store_scores(dst[b], _mm256_mul_ps(sums[b], vscale), cnt[b]);
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
        float *kt, const int BITS, const int WIDE) {
    /* BITS 32 / 16: float32 / bf16 rows, no parameters (group and values_bytes unused). window:
     * a row sees its last `window` keys only (0: all); keys before them score -inf here. WIDE:
     * the products by AVX-512 (qk_wide, pv_wide; kt: a tile of paired keys), the same bits. */
    const int64_t heads = kv_heads * gq;
    const float *rows[PV_SPAN * ATTEND_TILE];
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t t = t0; t < t1; t += ATTEND_TILE) {
        const int64_t m = t1 - t < ATTEND_TILE ? t1 - t : ATTEND_TILE;
        for (int64_t head = 0; head < kv_heads; head++) {
            tile_rows(pool, block_bytes, k_region, values_bytes, table, block_size, kv_heads, head_dim, group, head,
                      t, m, t1, tile, zeros, rows, BITS, WIDE);
            if (WIDE) {  /* every row's query heads of this KV head, four at a time */
                pair_keys(rows, head_dim, kt, BITS == 16);
                const float *qp[4];
                float *dst[4];
                int64_t cnt[4];
                int nb = 0;
                for (int64_t r = 0; r < R; r++) {
                    const int64_t mr = tile_seen(ends[r], t, t1, window);
                    if (!mr) continue;
                    for (int64_t j = r * heads + head * gq; j < r * heads + (head + 1) * gq; j++) {
                        qp[nb] = q + j * head_dim;
                        dst[nb] = scores + j * ATTEND_CHUNK + (t - t0);
                        cnt[nb++] = mr;
                        if (nb == 4) {
                            score_queries(qp, dst, cnt, nb, kt, head_dim, vscale);
                            nb = 0;
                        }
                    }
                }
                if (nb) score_queries(qp, dst, cnt, nb, kt, head_dim, vscale);
                continue;
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t mr = tile_seen(ends[r], t, t1, window);
                if (!mr) continue;
                for (int64_t j = r * heads + head * gq; j < r * heads + (head + 1) * gq; j++) {
                    __m256 a[ATTEND_TILE];
                    for (int i = 0; i < ATTEND_TILE; i++) a[i] = _mm256_setzero_ps();
                    for (int64_t k = 0; k < head_dim; k += 8) {
                        const __m256 qk = _mm256_loadu_ps(q + j * head_dim + k);
                        for (int i = 0; i < ATTEND_TILE; i++)
                            a[i] = _mm256_fmadd_ps(qk, _mm256_loadu_ps(rows[i] + k), a[i]);
                    }
                    store_scores(scores + j * ATTEND_CHUNK + (t - t0), _mm256_mul_ps(hsum8x8(a), vscale), mr);
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
            {  /* a maximum is exact in any order: 8 lanes (four chains of 16 where wide), then the rest */
                __m256 vmax = _mm256_set1_ps(-INFINITY);
                int64_t i = 0;
                if (WIDE) i = max_wide(s, n, &vmax);
                for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
                float lanes[8];
                _mm256_storeu_ps(lanes, vmax);
                for (int k = 0; k < 8; k++) m = fmaxf(m, lanes[k]);
                for (; i < n; i++) m = fmaxf(m, s[i]);
            }
            const __m256 vm = _mm256_set1_ps(m);
            __m256 sum = _mm256_setzero_ps();
            int64_t i = WIDE ? exp_wide(s, n, m, &sum) : 0;
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
    /* bf16 values widened where they are multiplied while a few queries read them (one pass
     * less over them), into the tile once where many do. Wide, without a window: PV_SPAN tiles
     * at a time, so that each query's outputs stay in registers over more keys (each output's
     * chain of multiply-adds is the same, key after key). */
    const int raw_v = WIDE && R * gq <= 8;
    const int64_t span = WIDE && window == 0 ? PV_SPAN * ATTEND_TILE : ATTEND_TILE;
    for (int64_t t = t0; t < t1; t += span) {
        const int64_t te = t + span < t1 ? t + span : t1;
        for (int64_t head = 0; head < kv_heads; head++) {
            for (int64_t u = t; u < te; u += ATTEND_TILE) {
                const int64_t mu = t1 - u < ATTEND_TILE ? t1 - u : ATTEND_TILE;
                tile_rows(pool, block_bytes, v_region, values_bytes, table, block_size, kv_heads, head_dim, group,
                          head, u, mu, t1, tile + (u - t) * head_dim, zeros, rows + (u - t), BITS,
                          raw_v || (WIDE && BITS == 16));
                if (WIDE && BITS == 16 && !raw_v) widen_bf16_rows(rows + (u - t), mu, head_dim, tile + (u - t) * head_dim);
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t mr = span_seen(ends[r], t, te, t1, window);
                if (!mr) continue;
                if (WIDE) {  /* this row and the next that see as many of the span: four queries at a time */
                    int64_t last = r;
                    while (last + 1 < R && span_seen(ends[last + 1], t, te, t1, window) == mr) last++;
                    float *ap[4];
                    const float *pp[4];
                    int nb = 0;
                    for (int64_t rr = r; rr <= last; rr++)
                        for (int64_t j = rr * heads + head * gq; j < rr * heads + (head + 1) * gq; j++) {
                            ap[nb] = acc + j * head_dim;
                            pp[nb++] = scores + j * ATTEND_CHUNK + (t - t0);
                            if (nb == 4) { pv_wide(ap, pp, nb, (int)mr, rows, head_dim, BITS == 16 && raw_v); nb = 0; }
                        }
                    if (nb) pv_wide(ap, pp, nb, (int)mr, rows, head_dim, BITS == 16 && raw_v);
                    r = last;
                    continue;
                }
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

/* A task's chunk: attend_chunk at the pool's bits (the compiler specialises each). The AVX-512
 * ones are compiled for it whole: the same operations, with its 32 vector registers (on 16 the
 * softmax's constants pushed its running sum through memory, a store and a load a vector). */
#define ATTEND(B, W) attend_chunk(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads, \
                                  head_dim, group, q, R, ends, gq, scale, window, t0, t1, m_out, l_out, acc, scores, \
                                  tile, zeros, kt, B, W)
static AVX512 void attend_chunk_wide(
        const uint8_t *pool, int64_t block_bytes, int64_t k_region, int64_t v_region, int64_t values_bytes,
        const int64_t *table, int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int bits,
        const float *q, int64_t R, const int64_t *ends, int64_t gq, float scale, int64_t window, int64_t t0,
        int64_t t1, float *m_out, float *l_out, float *acc, float *scores, float *tile, const float *zeros,
        float *kt) {
    if (bits == 8) ATTEND(8, 1);
    else if (bits == 4) ATTEND(4, 1);
    else if (bits == 16) ATTEND(16, 1);
    else ATTEND(32, 1);
}

static void attend_chunk_bits(
        const uint8_t *pool, int64_t block_bytes, int64_t k_region, int64_t v_region, int64_t values_bytes,
        const int64_t *table, int64_t block_size, int64_t kv_heads, int64_t head_dim, int64_t group, int bits,
        const float *q, int64_t R, const int64_t *ends, int64_t gq, float scale, int64_t window, int64_t t0,
        int64_t t1, float *m_out, float *l_out, float *acc, float *scores, float *tile, const float *zeros,
        float *kt) {
    if (avx512_cpu())
        attend_chunk_wide(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads, head_dim,
                          group, bits, q, R, ends, gq, scale, window, t0, t1, m_out, l_out, acc, scores, tile, zeros,
                          kt);
    else if (bits == 8) ATTEND(8, 0);
    else if (bits == 4) ATTEND(4, 0);
    else if (bits == 16) ATTEND(16, 0);
    else ATTEND(32, 0);
}
#undef ATTEND

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
#define ATTEND_ROWS 16
/* A sequence of at most this many rows (a decode, a verified draft, a hit's last tokens) has a
 * task per group of rows and chunk of context, so that its long context keeps every thread busy
 * as a one-row sequence's does (a task per group left one thread with 16 rows and the other with
 * 1 at 17); a longer one (a prefill chunk) a task per group of rows, which takes its chunks in
 * turn. */
#define SPLIT_ROWS 64
/* The split sequences' partial softmaxes together, at most (float32s); past it a sequence's
 * groups take their chunks in turn. */
#define SPLIT_FLOATS ((int64_t)16 << 20)

/* Task i: rows r0..r0+R-1 of sequence s; chunk >= 0: that chunk of context only, its partial
 * softmaxes at part + at; chunk -1: all its chunks, merged into out. */
typedef struct { int64_t s, r0, R, chunk, at; } attend_task;

/* Row r of a group of R rows of a split sequence: where its group's chunks' partials start in
 * part (a chunk's R x heads x (head_dim + 2) floats after another's), how many it sees, and its
 * row of q/out. */
typedef struct { int64_t at, r, R, chunks, row; } merge_row;

typedef struct {
    const uint8_t *pool; int64_t block_bytes, k_region, v_region, values_bytes; const int64_t *tables;
    int64_t table_width; const int64_t *contexts, *rows; int64_t block_size, kv_heads, head_dim, group; int bits;
    const float *q; int64_t gq; float scale; const float *sinks; int64_t window; float *out;
    const int64_t *row0; const attend_task *tasks; const merge_row *merges; float *part;
    _Atomic int failed;
} attend_call;

/* Tasks t0..t1-1 of kvc_attend_kv. */
static void attend_tasks(void *ctx, int64_t t0_, int64_t t1_, int thread) {
    (void)thread;
    attend_call *c = ctx;
    const uint8_t *pool = c->pool;
    const int64_t block_bytes = c->block_bytes, k_region = c->k_region, v_region = c->v_region;
    const int64_t values_bytes = c->values_bytes, table_width = c->table_width, block_size = c->block_size;
    const int64_t kv_heads = c->kv_heads, head_dim = c->head_dim, group = c->group, gq = c->gq, window = c->window;
    const int64_t heads = kv_heads * gq;
    const int bits = c->bits;
    const float scale = c->scale, *q = c->q, *sinks = c->sinks;
    const int64_t *tables = c->tables, *contexts = c->contexts, *rows = c->rows, *row0 = c->row0;
    float *out = c->out, *part = c->part;
    /* the thread's scores, tile, zeros and paired keys, kept for its next call (a fresh
     * allocation this size is mapped and faulted in page by page at every call) */
    const int64_t room = ATTEND_ROWS * heads * ATTEND_CHUNK + ((PV_SPAN + 1) * ATTEND_TILE + 1) * head_dim;
    float *scores = thread_kept(KEPT_ATTEND, room * (int64_t)sizeof(float));
    if (!scores) {
        atomic_store(&c->failed, 1);
        return;
    }
    float *tile = scores + ATTEND_ROWS * heads * ATTEND_CHUNK;  /* PV_SPAN tiles of values */
    float *kt = tile + PV_SPAN * ATTEND_TILE * head_dim;
    memset(kt + ATTEND_TILE * head_dim, 0, head_dim * sizeof(float));
    const float *zeros = kt + ATTEND_TILE * head_dim;
    for (int64_t i = t0_; i < t1_; i++) {
        const attend_task *task = c->tasks + i;
        const int64_t s = task->s, r0 = task->r0, R = task->R;
        const int64_t *table = tables + s * table_width;
        const float *qs = q + (row0[s] + r0) * heads * head_dim;
        int64_t ends[ATTEND_ROWS];  /* row r sees the tokens before ends[r] */
        for (int64_t r = 0; r < R; r++) ends[r] = contexts[s] - rows[s] + 1 + r0 + r;
        /* per chunk: R x heads x head_dim values, then R x heads maxima and R x heads sums */
        const int64_t per = R * heads * (head_dim + 2);
        if (task->chunk >= 0) {
            const int64_t t0 = task->chunk * ATTEND_CHUNK;
            const int64_t t1 = t0 + ATTEND_CHUNK < ends[R - 1] ? t0 + ATTEND_CHUNK : ends[R - 1];
            float *cp = part + task->at, *m = cp + R * heads * head_dim;
            attend_chunk_bits(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads,
                              head_dim, group, bits, qs, R, ends, gq, scale, window, t0, t1, m, m + R * heads, cp,
                              scores, tile, zeros, kt);
            continue;
        }
        const int64_t chunks = (ends[R - 1] + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
        float *own = malloc(chunks * per * sizeof(float));
        if (!own) {
            atomic_store(&c->failed, 1);
            continue;
        }
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t t0 = ch * ATTEND_CHUNK;
            const int64_t t1 = t0 + ATTEND_CHUNK < ends[R - 1] ? t0 + ATTEND_CHUNK : ends[R - 1];
            float *cp = own + ch * per, *m = cp + R * heads * head_dim;
            attend_chunk_bits(pool, block_bytes, k_region, v_region, values_bytes, table, block_size, kv_heads,
                              head_dim, group, bits, qs, R, ends, gq, scale, window, t0, t1, m, m + R * heads, cp,
                              scores, tile, zeros, kt);
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
}

/* The split sequences' rows' heads rj0..rj1-1 (merge row i's head j at i x heads + j): their
 * chunks merged, in order. */
static void merge_heads(void *ctx, int64_t rj0, int64_t rj1, int thread) {
    (void)thread;
    const attend_call *c = ctx;
    const int64_t heads = c->kv_heads * c->gq, head_dim = c->head_dim;
    for (int64_t rj = rj0; rj < rj1; rj++) {
        const merge_row *mr = c->merges + rj / heads;
        const int64_t j = rj % heads, R = mr->R, per = R * heads * (head_dim + 2);
        const float *base = c->part + mr->at;
        const float *m = base + R * heads * head_dim + mr->r * heads + j;
        merge_chunks(m, m + R * heads, per, base + (mr->r * heads + j) * head_dim, per, mr->chunks, head_dim,
                     c->sinks ? c->sinks[j] : -INFINITY, c->out + (mr->row * heads + j) * head_dim);
    }
}

/* Attention of query positions over their sequence's KV blocks, read where they lie (no
 * gathered or dequantized copy of the context); bits 8 or 4 (packed, kvc_gather_kv's layout),
 * 16 or 32 (bf16 or float32 blocks, [layers, 2, block_size, kv_heads, head_dim]). Sequence s
 * has rows[s] query rows (its decode token: 1; a prefill chunk: its tokens), the last one
 * seeing the first contexts[s] tokens of the blocks in tables[s * table_width ...] and each
 * earlier one a token fewer (causal). q float32 [sum of rows, kv_heads, gq, head_dim] (the gq
 * query heads of each KV head; a sequence's rows one after the other), out the same shape.
 * Every (query row, chunk of ATTEND_CHUNK tokens) has its own softmax per query head, and the
 * chunks merge through their maxima and sums in order, by the same operations for every row
 * however many rows its sequence has and however its work is split: a token's attention does
 * not depend on the step it runs in. A short sequence's rows (SPLIT_ROWS at most) go
 * ATTEND_ROWS at a time with a task per chunk (a long context keeps every thread busy); a
 * longer sequence's groups of rows a task each, taking their chunks in turn. head_dim a
 * multiple of 16. Returns 0; -1 if scratch memory could not be had, -2 if a block it would
 * read lies outside the pool's n_blocks or a context outside its table (out untouched). */
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
    /* which sequences split (a one-row one always), their tasks and merge rows counted */
    int64_t n_tasks = 0, n_merges = 0, floats = 0;
    char *split = malloc(n_seq + 1);
    int64_t *row0 = malloc((n_seq + 1) * sizeof(int64_t));
    if (!split || !row0) { free(split); free(row0); return -1; }
    row0[0] = 0;
    for (int64_t s = 0; s < n_seq; s++) {
        const int64_t groups = (rows[s] + ATTEND_ROWS - 1) / ATTEND_ROWS;
        const int64_t chunks = (contexts[s] + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
        const int64_t need = chunks * rows[s] * heads * (head_dim + 2);
        split[s] = rows[s] == 1 || (rows[s] <= SPLIT_ROWS && chunks > 1 && floats + need <= SPLIT_FLOATS);
        row0[s + 1] = row0[s] + rows[s];
        if (split[s]) {
            floats += need;
            n_tasks += groups * chunks;
            n_merges += rows[s];
        } else {
            n_tasks += groups;
        }
    }
    attend_task *tasks = malloc((n_tasks + 1) * sizeof(attend_task));
    merge_row *merges = malloc((n_merges + 1) * sizeof(merge_row));
    float *part = malloc((floats + 1) * sizeof(float));
    if (!tasks || !merges || !part) {
        free(split); free(row0); free(tasks); free(merges); free(part);
        return -1;
    }
    int64_t t = 0, mi = 0, at = 0;
    for (int64_t s = 0; s < n_seq; s++)
        for (int64_t r0 = 0; r0 < rows[s]; r0 += ATTEND_ROWS) {
            const int64_t R = rows[s] - r0 < ATTEND_ROWS ? rows[s] - r0 : ATTEND_ROWS;
            if (!split[s]) {
                tasks[t++] = (attend_task){s, r0, R, -1, 0};
                continue;
            }
            /* the group's last row sees the most chunks; each row merges those it sees */
            const int64_t last = contexts[s] - rows[s] + r0 + R;
            const int64_t chunks = (last + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
            for (int64_t r = 0; r < R; r++) {
                const int64_t end = contexts[s] - rows[s] + 1 + r0 + r;
                merges[mi++] = (merge_row){at, r, R, (end + ATTEND_CHUNK - 1) / ATTEND_CHUNK, row0[s] + r0 + r};
            }
            for (int64_t ch = 0; ch < chunks; ch++, at += R * heads * (head_dim + 2))
                tasks[t++] = (attend_task){s, r0, R, ch, at};
        }
    attend_call c = {pool, block_bytes, k_region, v_region, values_bytes, tables, table_width, contexts, rows,
                     block_size, kv_heads, head_dim, group, bits, q, gq, scale, sinks, window, out, row0, tasks,
                     merges, part, 0};
    pool_for(threads, t, 1, attend_tasks, &c);
    const int failed = atomic_load(&c.failed);
    if (!failed && mi)
        pool_for(at > 65536 ? threads : 1, mi * heads, heads, merge_heads, &c);
    free(split);
    free(row0);
    free(tasks);
    free(merges);
    free(part);
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
